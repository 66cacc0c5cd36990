"""The device's caching allocator, read without disturbing it or the user.

The offloader reads what a device allocates and holds to measure a step for a goal's plan
and to check a limit; the finders read what a step leaves allocated, reserved, and in
blocks a live tensor splits, to tell a leak from the allocator's cache. Neither may change
what the user reads: nothing here resets the peak statistics (a trainer that resets them
at a step's start and logs ``max_memory_allocated`` at its end would log leakfree's
window instead), and the counts are read without building the flat statistics dictionary
``torch.cuda.memory_stats()`` sorts on every call.

:class:`Counts` is one reading: what is allocated and reserved now, and their peaks since
the process began (or since the user last reset them). A step's own peak is seen as a
*delta* (:class:`Span`): where the process's peak rose during the step, it is the step's;
where it did not, the step stayed under an earlier peak, and the most it allocated is
known only at the points read (the step's saves and unpacks, where the offloader reads).
What is reserved only falls when the cache is emptied (by ``empty_cache`` or an
out-of-memory retry), so what a step held is what is reserved at its end, or the peak if
that rose. :func:`reader` picks the cheapest way each device offers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from leakfree._device import device_index


class Counts(NamedTuple):
    """One reading of a device's allocator, in bytes: allocated and reserved now, the peak
    of each (since the process began, or the user's last reset), and every byte ever
    allocated (a running total the allocator keeps; 0 where it keeps none)."""

    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int
    total_allocated: int = 0
    #: free bytes in segments a live block splits: held, and not given back by
    #: ``empty_cache`` (fragmentation)
    inactive_split: int = 0


def reader(device: torch.device, module: Any) -> Callable[[], Counts] | None:
    """A function reading ``device``'s :class:`Counts` (``module``: its device module, as
    ``torch.cuda``); None where the device reports no allocator statistics.

    CUDA: the allocator's nested statistics (one call, no flattening or sorting); another
    accelerator torch knows: ``torch._C._accelerator_getDeviceStats``, the same; else the
    module's ``memory_stats()``, or its ``memory_allocated()`` and friends."""
    if module is None:
        return None
    index = device_index(device)
    nested = _nested(device, module, index)
    if nested is not None:
        stats = nested

        def read_nested() -> Counts:
            d = stats(index)
            allocated, reserved = d["allocated_bytes"]["all"], d["reserved_bytes"]["all"]
            return Counts(
                int(allocated["current"]),
                int(reserved["current"]),
                int(allocated["peak"]),
                int(reserved["peak"]),
                int(allocated.get("allocated", 0)),
                int(d.get("inactive_split_bytes", {}).get("all", {}).get("current", 0)),
            )

        return read_nested
    flat = getattr(module, "memory_stats", None)
    if flat is not None:

        def read_flat() -> Counts:
            d = flat(device)
            return Counts(
                int(d.get("allocated_bytes.all.current", 0)),
                int(d.get("reserved_bytes.all.current", 0)),
                int(d.get("allocated_bytes.all.peak", 0)),
                int(d.get("reserved_bytes.all.peak", 0)),
                int(d.get("allocated_bytes.all.allocated", 0)),
                int(d.get("inactive_split_bytes.all.current", 0)),
            )

        return read_flat
    allocated = getattr(module, "memory_allocated", None)
    if allocated is None:
        return None
    peak = getattr(module, "max_memory_allocated", allocated)
    reserved = getattr(module, "memory_reserved", allocated)
    peak_reserved = getattr(module, "max_memory_reserved", reserved)

    def read_calls() -> Counts:
        return Counts(
            int(allocated(device)),
            int(reserved(device)),
            int(peak(device)),
            int(peak_reserved(device)),
        )

    return read_calls


def _nested(
    device: torch.device, module: Any, index: int
) -> Callable[[int], dict[str, Any]] | None:
    """The one call that gives ``device``'s allocator statistics nested (CUDA's, or the
    current accelerator's through ``torch._C``), where it answers with them; else None.
    (A backend registered from Python, as the test suite's simulated device, has its
    module's functions only.)"""
    if module is getattr(torch, "cuda", None):
        call = getattr(torch._C, "_cuda_memoryStats", None)
    elif getattr(torch.accelerator.current_accelerator(), "type", None) == device.type:
        call = getattr(torch._C, "_accelerator_getDeviceStats", None)
    else:
        call = None
    if call is None:
        return None
    try:
        d = call(index)
        d["allocated_bytes"]["all"]["peak"], d["reserved_bytes"]["all"]["peak"]
    except (RuntimeError, KeyError, TypeError):
        return None
    return call  # type: ignore[no-any-return]


class Span:
    """What the device allocated and held over a stretch of work, as deltas from where it
    began (never resetting the peaks): :meth:`read` at each point of interest returns the
    most allocated since the point before it, and :attr:`held` is the most reserved so far
    (the peak where it rose, else the counts read).

    The most allocated between two points is exact where the process's peak rose
    meanwhile. Where it did not (the stretch stayed under an earlier peak), it is bounded
    from above: what was allocated at the first point and every byte allocated since (as
    if nothing were freed in between), and by the process's peak; the plans that read it
    then err on the side of the device's room. Without a running total, the larger of the
    two points' counts (from below)."""

    def __init__(self, read: Callable[[], Counts]) -> None:
        self._read = read
        first = read()
        self.start = first
        self._last = first
        self.held = first.reserved
        #: the most allocated known for certain (an exact peak, or a count read): what the
        #: device held beyond it is not the allocator's count's
        self.seen = first.allocated

    def read(self) -> tuple[int, int]:
        """What is allocated now, and the most allocated since the last read."""
        now = self._read()
        last = self._last
        if now.peak_allocated > last.peak_allocated:
            most = now.peak_allocated  # the process's peak rose: it is this stretch's
            self.seen = max(self.seen, most)
        elif now.total_allocated > last.total_allocated:
            added = now.total_allocated - last.total_allocated
            most = min(last.allocated + added, now.peak_allocated)
        else:
            most = max(last.allocated, now.allocated)
        if now.peak_reserved > last.peak_reserved:
            self.held = max(self.held, now.peak_reserved)
        self.held = max(self.held, now.reserved)
        self.seen = max(self.seen, now.allocated)
        self._last = now
        return now.allocated, most
