"""Fragmentation of the caching allocator as a training-step pattern, with no leak in it.

A finder that watches ``memory_reserved`` must tell this from a leak: memory the device
holds grows every step while no tensor outlives its step. The pattern is the common one
of shapes that grow (curriculum lengths, packing that fills up): each step's temporary
is larger than any cached block, so the allocator reserves a new segment for it, and a
small tensor kept into the next step (a logged value, a carried state) lands in a cached
segment and splits it. What the steps allocate is flat; what they reserve grows by the
new temporary each step; ``empty_cache`` (or an out-of-memory retry) gives back all but
the segment the kept tensor splits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

MiB = 1 << 20


@dataclass(frozen=True)
class Sample:
    """The device's allocator after one step (bytes)."""

    allocated: int  #: ``memory_allocated``
    reserved: int  #: ``memory_reserved``
    inactive_split: int  #: free bytes in segments a live block splits (not releasable)


def sample(device: torch.device) -> Sample:
    module: Any = torch.get_device_module(device)
    stats = module.memory_stats(device)
    return Sample(
        module.memory_allocated(device),
        module.memory_reserved(device),
        stats["inactive_split_bytes.all.current"],
    )


def growing_steps(
    device: torch.device,
    steps: int,
    *,
    first: int = 20 * MiB,
    growth: int = 2 * MiB,
    kept: int = 3 * MiB // 2,
) -> Iterator[Sample]:
    """Run ``steps`` steps on ``device`` and yield the allocator after each: a temporary
    of ``first + i * growth`` bytes at step ``i``, and a tensor of ``kept`` bytes made in
    each step and dropped in the next. Nothing is kept beyond that one tensor (freed when
    the generator is closed)."""
    carried: torch.Tensor | None = None
    for i in range(steps):
        temporary = torch.empty(first + i * growth, dtype=torch.uint8, device=device)
        new = torch.empty(kept, dtype=torch.uint8, device=device)
        del temporary
        carried = new
        del new
        yield sample(device)
    del carried
