"""The one seam between leakfree and a device: which accelerator there is, and its module.

Everything that uses streams, events, pinned memory or allocator statistics asks here,
through ``torch.accelerator`` and ``torch.get_device_module``, never ``torch.cuda``
directly. CUDA, XPU and out-of-tree backends (the test suite's simulated device among
them) therefore take one and the same path.
"""

from __future__ import annotations

from typing import Any

import torch


def accelerator() -> torch.device | None:
    """The current accelerator, or None on a machine without one."""
    if not torch.accelerator.is_available():
        return None
    return torch.accelerator.current_accelerator()


def device_module(device: torch.device) -> Any:
    """``torch.cuda`` for a CUDA device, and so on; None for the CPU."""
    return None if device.type == "cpu" else torch.get_device_module(device.type)


def device_index(device: torch.device) -> int:
    """``device``'s index, or the current device's where it names none (``"cuda"``)."""
    if device.index is not None:
        return device.index
    return torch.accelerator.current_device_index()
