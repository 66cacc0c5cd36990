"""Graph capture beside offloading: what a manager does while a stream captures a graph.

Copies to the host, their events and pinned host memory cannot be captured, and a
captured copy would replay into memory the graph does not own. A manager entered while
the current stream captures refuses (:meth:`Capture.refuse_entry`); a capture begun
inside the ``with`` keeps the tensors saved during it on the device, as plain PyTorch
does (:meth:`Capture.keeps`), and says so once.

Kept: the device module's query (or None where the device cannot capture) and whether
the warning was given.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from leakfree.offload.pool import OffloadWarning


class Capture:
    """Whether the current stream captures a graph, for one manager (see the module doc)."""

    def __init__(self, module: Any) -> None:
        self._capturing: Callable[[], bool] | None = getattr(
            module, "is_current_stream_capturing", None
        )
        self._warned = False

    def active(self) -> bool:
        """Whether the current stream captures a graph now."""
        return self._capturing is not None and self._capturing()

    def refuse_entry(self) -> None:
        """Raise if the manager is entered while the current stream captures."""
        if self.active():
            raise RuntimeError(
                "OffloadActivations: entered while the current stream captures a graph "
                "(torch.cuda.graph, or torch.compile's CUDA graphs); copies to the host, "
                "their events and pinned memory cannot be captured. Enter it outside the "
                "captured region, or leave the region's activations on the device "
                "(leakfree.NoOffload)"
            )

    def keeps(self) -> None:
        """A tensor is saved during a capture: it stays on the device (warned once)."""
        if not self._warned:
            self._warned = True
            warnings.warn(
                "OffloadActivations: tensors saved while a graph is captured stay on the "
                "device (copies to the host cannot be captured); enter the context outside "
                "the captured region to offload around it",
                OffloadWarning,
                stacklevel=4,
            )
