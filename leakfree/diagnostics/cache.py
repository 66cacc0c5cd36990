"""The allocator's cache and fragmentation, told from a leak.

On an accelerator the finders judge what the allocator counts *allocated*: a tensor kept
from step to step is there. What the device *holds* is more: the caching allocator keeps
freed blocks for reuse (its cache), and a segment that a live tensor splits cannot be
given back whatever is free in it (fragmentation). Both can grow step after step with no
tensor kept (shapes that grow, a small tensor carried into the next step landing in a
cached segment), and both end in an out-of-memory error as a leak does; but the fix is
another: not a reference to drop, a knob of the allocator.

:class:`AllocatorGrowth` reads a device's allocator once per step (one statistics call,
never resetting anything: :mod:`leakfree._allocator`) and, at the end, says which grew:
what is allocated (a leak, the detector's to name), what is reserved beyond it (the
cache: ``empty_cache`` gives it back; fragmentation: ``expandable_segments`` avoids it),
or nothing. It keeps a number per step, at most :data:`POINTS` of them (evenly spread).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from leakfree._allocator import Counts, reader
from leakfree._device import device_module
from leakfree._text import format_bytes

__all__ = ["AllocatorGrowth", "CacheVerdict"]

#: the most steps' readings kept (every other one dropped when full)
POINTS = 256

#: what the cache must grow by, over the steps after the warm-up, to be reported: this
#: many bytes at least, and a 16th of what the device allocates at the end
LEAST = 4 << 20


@dataclass(frozen=True)
class CacheVerdict:
    """What grew on a device's allocator from the end of the warm-up to the last step:
    ``allocated`` (what tensors hold), ``cached`` (reserved beyond allocated, free blocks
    the allocator keeps), of it ``split`` (free bytes in segments a live tensor splits,
    which ``empty_cache`` cannot give back), over ``steps`` steps; ``kind``: ``"leak"``
    (allocated grew), ``"cache"`` (reserved grew and allocated did not), ``"both"``, or
    ``"none"``; ``message``: what to do, for a human."""

    kind: str
    steps: int
    allocated: int
    cached: int
    split: int
    message: str


class AllocatorGrowth:
    """A device's allocator read at each :meth:`step` (see the module doc)."""

    def __init__(self, device: torch.device, read: Callable[[], Counts] | None = None) -> None:
        self.device = device
        self._read = read if read is not None else reader(device, device_module(device))
        self.readings: list[Counts] = []
        self.at: list[int] = []  # the step of each reading
        self._steps = 0
        self._stride = 1

    @property
    def available(self) -> bool:
        """Whether the device reports its allocator (an accelerator's does)."""
        return self._read is not None

    def step(self) -> None:
        """Read the allocator as a step ends."""
        index = self._steps
        self._steps += 1
        if self._read is None or (index % self._stride and index):
            return
        self.readings.append(self._read())
        self.at.append(index)
        if len(self.readings) > POINTS:
            del self.readings[1::2], self.at[1::2]
            self._stride *= 2

    def verdict(self, warmup: int) -> CacheVerdict | None:
        """What grew from the first reading after ``warmup`` steps to the last (None: not
        two readings then)."""
        pairs = [(i, c) for i, c in zip(self.at, self.readings) if i >= warmup]
        if len(pairs) < 2:
            return None
        (first_at, first), (last_at, last) = pairs[0], pairs[-1]
        allocated = last.allocated - first.allocated
        cached = (last.reserved - last.allocated) - (first.reserved - first.allocated)
        split = last.inactive_split - first.inactive_split
        least = max(LEAST, last.allocated // 16)
        grew_cache = cached > least
        grew_allocated = allocated > least
        kind = {
            (True, True): "both",
            (True, False): "leak",
            (False, True): "cache",
            (False, False): "none",
        }[(grew_allocated, grew_cache)]
        steps = last_at - first_at
        return CacheVerdict(kind, steps, allocated, cached, split, _message(kind, steps, last,
                            allocated, cached, split))  # fmt: skip


def _message(kind: str, steps: int, last: Counts, allocated: int, cached: int, split: int) -> str:
    if kind in ("none", "leak"):
        held = format_bytes(last.reserved)
        if kind == "none":
            return f"the allocator's cache stayed flat ({held} held at the end)"
        return (
            f"what tensors hold grew by {format_bytes(allocated)} over {steps} steps (a leak: "
            f"see what holds it); the allocator's cache stayed flat ({held} held)"
        )
    knobs = []
    releasable = max(0, cached - split)
    if releasable > 0:
        knobs.append(
            f"`torch.cuda.empty_cache()` gives back about {format_bytes(releasable)} "
            "(the cached segments no tensor splits), at the cost of allocating them again"
        )
    if split > 0:
        knobs.append(
            f"{format_bytes(split)} of it is free space in segments live tensors split "
            "(fragmentation), which empty_cache cannot give back: "
            "`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` grows segments instead of "
            "reserving new ones for larger tensors"
        )
    else:
        knobs.append(
            "`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` grows segments instead of "
            "reserving new ones for larger tensors (shapes that grow)"
        )
    head = (
        f"the allocator's cache grew by {format_bytes(cached)} over {steps} steps "
        f"(reserved but not allocated; {format_bytes(last.reserved)} held at the end)"
    )
    if kind == "cache":
        head += (
            f", while what tensors hold stayed within {format_bytes(max(allocated, 0))}: "
            "not a leak, the allocator keeping freed blocks"
        )
    else:
        head += f", beside the leak (what tensors hold grew by {format_bytes(allocated)})"
    return head + "; " + "; ".join(knobs)
