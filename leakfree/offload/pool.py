"""The host side of offloading: size classes, reusable blocks, made ahead of need.

A :class:`HostBlock` is one host buffer (pinned where the pool pins). A
:class:`HostBlockPool` hands blocks out and takes them back; it keeps *free* blocks only,
within a :class:`~leakfree.offload.budget.HostBudget` shared by every pool that does not
bring its own (:data:`PROCESS_BUDGET`: this process's share of the node). A block in use
belongs to the host copy that holds it, and so to the autograd graph: the pool never
holds a reference to it. Between steps (when a backward pass ends) the pool makes the
blocks the next step will take, so a forward's copies out find theirs made.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import torch

from leakfree.errors import OffloadWarning
from leakfree.offload.budget import (
    PROCESS_BUDGET,
    HostBudget,
    default_budget,
    local_world_size,
    release_host_cache,
)

__all__ = [
    "PROCESS_BUDGET",
    "HostBlock",
    "HostBlockPool",
    "HostBudget",
    "OffloadWarning",
    "PoolStats",
    "default_budget",
    "local_world_size",
    "release_host_cache",
]


def _size_class(nbytes: int) -> int:
    """Pool blocks come in size classes: powers of two, from 4 KiB.

    PyTorch's caching host allocator rounds every pinned allocation up to a power of two,
    so a block of a size class pins exactly its size: the budget counts real bytes.
    """
    return 1 << max(12, (nbytes - 1).bit_length())


class HostBlock:
    """One host buffer (a 1-D ``uint8`` tensor) from a :class:`HostBlockPool`.

    ``event`` is the last device event that reads or writes it, until it is seen to have
    completed (None then). The pool may hand a block out before that: whoever writes it
    orders the writes after ``event`` on the device (``stream.wait_event``).
    """

    __slots__ = ("__weakref__", "budget", "data", "event", "pinned", "pooled", "size", "views")

    def __init__(self, size: int, pinned: bool, budget: HostBudget | None = None) -> None:
        self.size = size
        self.pinned = pinned
        self.pooled = budget is not None
        self.budget = budget  # the budget this block's bytes are reserved in, if any
        self.data = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        self.event: Any = None
        #: typed views of its bytes, as host copies used them: a block is reused step after
        #: step by copies of the same sizes and dtypes, so each is made once
        self.views: dict[tuple[int, int, torch.dtype, Any], torch.Tensor] = {}

    def view(
        self, nbytes: int, dtype: torch.dtype, shape: Any = None, offset: int = 0
    ) -> torch.Tensor:
        """Bytes ``[offset, offset + nbytes)`` as a flat ``dtype`` tensor, or of ``shape``
        (cached)."""
        key = (offset, nbytes, dtype, shape)
        out = self.views.get(key)
        if out is None:
            data = self.data if nbytes == self.size else self.data[offset : offset + nbytes]
            out = data.view(dtype) if shape is None else data.view(dtype).view(shape)
            if len(self.views) >= 64:  # a block reused for many layouts: keep the newest
                self.views.clear()
            self.views[key] = out
        return out

    def ready(self) -> bool:
        """Whether its last device use has completed (then ``event`` is forgotten)."""
        event = self.event
        if event is None:
            return True
        if event.query():
            self.event = None
            return True
        return False

    def __del__(self) -> None:
        budget = getattr(self, "budget", None)
        if budget is not None:
            budget.give_back(self.size, self.pinned)


@dataclass
class PoolStats:
    """Byte and event counts of a :class:`HostBlockPool` (sizes are size classes).

    A *step*, here, runs from one :meth:`HostBlockPool.prepare` (the end of a backward
    pass) to the next."""

    in_use_bytes: int = 0  #: held by live host copies
    cached_bytes: int = 0  #: free blocks kept for reuse
    pooled_bytes: int = 0  #: in use + cached, of blocks within the budget
    allocations: int = 0  #: new blocks within the budget (on demand or ahead)
    reuses: int = 0  #: acquires served from the cache
    overflows: int = 0  #: new blocks beyond the budget (pageable, freed on release)
    misses: int = 0  #: acquires that found no free block of their class: made one then
    step_misses: int = 0  #: misses in this step (0 once the pool makes what a step takes)
    ahead: int = 0  #: blocks made between steps, ahead of need (in ``allocations`` too)


class HostBlockPool:
    """Reusable host blocks within a byte budget, pinned when ``pin``.

    ``budget``: bytes (a budget of this pool's own), a :class:`HostBudget` (shared with
    the pools given the same one), or None for :data:`PROCESS_BUDGET`.

    ``acquire(n)`` returns a block of at least ``n`` bytes: a free block of the same size
    class (one whose last device use has completed if there is one, else the oldest, which
    the caller orders its writes after), else a new one. New blocks join the pool while
    the budget has room, evicting free blocks of other size classes (least recently used
    first, their copies completed) to make it; beyond it they are pageable "overflow"
    blocks, freed again on release (with ``pin``, copies to them are synchronous: an
    :class:`OffloadWarning` is issued once).

    ``prepare()`` ends a step: it makes, ahead of need, the blocks the last step that took
    any held at once, less those out and free, so the next step's acquires find them.

    ``release`` never blocks and never allocates (it runs from the finalizers of host
    copies, possibly inside a garbage collection triggered while the pool is busy): it
    queues the block, and the next ``acquire``, ``prepare``, ``trim`` or ``stats`` read
    takes it back.

    Kept: the free blocks (until evicted, trimmed, or the pool dies) and, per size class,
    counts of blocks out and of what the last step held at once.
    """

    def __init__(self, budget: int | HostBudget | None = None, *, pin: bool = True) -> None:
        if budget is not None and not isinstance(budget, HostBudget):
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                raise ValueError(
                    f"HostBlockPool(budget={budget!r}): must be an int >= 0 (bytes), a "
                    "HostBudget, or None for the process-wide budget"
                )
            budget = HostBudget(budget)
        self.host_budget = PROCESS_BUDGET if budget is None else budget
        self.pin = pin
        self._stats = PoolStats()
        self._free: OrderedDict[int, HostBlock] = OrderedDict()  # id -> block, LRU first
        self._by_size: dict[int, dict[int, HostBlock]] = {}  # size class -> its free blocks
        self._returned: deque[tuple[HostBlock, bool]] = deque()
        self._lock = threading.RLock()
        self._warned = False
        self._out: dict[int, int] = {}  # size class -> blocks handed out, not yet back
        self._peak: dict[int, int] = {}  # size class -> most out at once in this step
        self._need: dict[int, int] = {}  # the same, of the last step that acquired
        self._acquired = False  # whether this step acquired any

    @property
    def budget(self) -> int:
        """The byte limit of the budget this pool draws from (shared unless its own)."""
        return self.host_budget.limit

    @property
    def stats(self) -> PoolStats:
        with self._lock:
            self._drain()
            return dataclasses.replace(self._stats)

    def _drain(self) -> None:
        # Called with the lock held. popleft/append on a deque are atomic: no lock needed
        # on the release side.
        while self._returned:
            block, reuse = self._returned.popleft()
            self._stats.in_use_bytes -= block.size
            self._out[block.size] -= 1
            if block.pooled and reuse:
                self._cache(block)
            elif block.pooled:  # its memory lives on in views: it leaves the pool
                self._stats.pooled_bytes -= block.size

    def _cache(self, block: HostBlock) -> None:
        """Put a free block in the free lists (lock held)."""
        self._free[id(block)] = block
        self._by_size.setdefault(block.size, {})[id(block)] = block
        self._stats.cached_bytes += block.size

    def acquire(self, nbytes: int) -> HostBlock:
        size = _size_class(nbytes)
        with self._lock:
            if self._returned:
                self._drain()
            out = self._out[size] = self._out.get(size, 0) + 1
            if out > self._peak.get(size, 0):
                self._peak[size] = out
            self._acquired = True
            stats = self._stats
            stats.in_use_bytes += size
            same = self._by_size.get(size)
            if same:
                # a completed one, else the oldest: its next copy waits for it on the
                # device, where a new block would cost an allocation that blocks the host
                block = next((b for b in same.values() if b.ready()), None)
                if block is None:
                    block = next(iter(same.values()))
                self._take(block)
                stats.cached_bytes -= size
                stats.reuses += 1
                return block
            stats.misses += 1
            stats.step_misses += 1
            pooled = self._reserve(size)
            if pooled:
                stats.pooled_bytes += size
                stats.allocations += 1
            else:
                stats.overflows += 1
            warn = not pooled and self.pin and not self._warned
            self._warned = self._warned or warn
        if warn:
            warnings.warn(
                f"OffloadActivations: the pinned host memory budget ({self.budget} bytes) is "
                "used up; further host copies use pageable memory and are synchronous. "
                "Raise pin_memory_budget, or offload less (min_offload_size, NoOffload).",
                OffloadWarning,
                stacklevel=5,
            )
        try:
            return HostBlock(
                size, pinned=pooled and self.pin, budget=self.host_budget if pooled else None
            )
        except BaseException:
            with self._lock:
                self._out[size] -= 1
                stats.in_use_bytes -= size
                if pooled:
                    stats.pooled_bytes -= size
                    self.host_budget.give_back(size, self.pin)  # (as if it had been made)
            raise

    def _reserve(self, size: int, keep: dict[int, int] | None = None) -> bool:
        """Count a new block of ``size`` in the budget (lock held), making room if need be:
        free blocks of other classes are evicted (those ``keep`` asks for excepted), and
        freed pinned bytes the host allocator still caches are given back to the system."""
        budget = self.host_budget
        if budget.try_reserve(size, self.pin):
            return True
        self._evict_for(size, keep)
        if budget.try_reserve(size, self.pin):
            return True
        if budget.parked and budget.live + size <= budget.limit:
            release_host_cache()  # once per change of shapes on a full budget
            return budget.try_reserve(size, self.pin)
        return False

    def _evict_for(self, size: int, keep: dict[int, int] | None = None) -> None:
        """Free free blocks whose last copy has completed (least recently used first)
        until ``size`` fits beside the live blocks, keeping ``keep[c]`` blocks of each
        class ``c`` (lock held)."""
        budget = self.host_budget
        limit = budget.limit
        for key in list(self._free):
            if budget.live + size <= limit:
                return
            block = self._free[key]
            if keep is not None and len(self._by_size[block.size]) <= keep.get(block.size, 0):
                continue
            if block.ready():
                self._take(block)
                self._stats.cached_bytes -= block.size
                self._stats.pooled_bytes -= block.size
                del block  # its finalizer gives its bytes back (parked, if pinned)

    def _take(self, block: HostBlock) -> None:
        """Remove a free block from the free lists (lock held)."""
        del self._free[id(block)]
        del self._by_size[block.size][id(block)]

    def release(self, block: HostBlock, *, reuse: bool = True) -> None:
        """Give ``block`` back (``reuse=False``: its memory is still viewed elsewhere, so
        it leaves the pool instead of being handed out again)."""
        self._returned.append((block, reuse))

    def prepare(self) -> int:
        """End a step (the front calls it when a backward pass ends): make, ahead of need,
        the blocks of each size class the last step that acquired held at once, less
        those out (they come back) and those free, within the budget; returns the bytes
        made. A step that acquired nothing (the second backward of two forwards) leaves
        what is needed as it was. Made blocks are free: the pool holds no block in use."""
        with self._lock:
            self._drain()
            if self._acquired:
                self._need = self._peak
            self._peak = {size: n for size, n in self._out.items() if n}
            self._acquired = False
            self._stats.step_misses = 0
            keep = {size: n - self._out.get(size, 0) for size, n in self._need.items()}
            made = []
            for size, n in sorted(keep.items(), reverse=True):
                for _ in range(n - len(self._by_size.get(size, ()))):
                    if not self._reserve(size, keep):
                        break
                    made.append(size)
        blocks = []
        for i, size in enumerate(made):  # outside the lock: pinning may take a while
            try:
                blocks.append(HostBlock(size, pinned=self.pin, budget=self.host_budget))
            except RuntimeError:  # out of host memory: the next step makes them on demand
                for unmade in made[i:]:
                    self.host_budget.give_back(unmade, self.pin)
                break
        with self._lock:
            for block in blocks:
                self._cache(block)
                self._stats.pooled_bytes += block.size
                self._stats.allocations += 1
                self._stats.ahead += 1
        return sum(block.size for block in blocks)

    def trim(self) -> int:
        """Free every cached block; returns the bytes freed.

        Pinned memory goes back to PyTorch's host allocator, which keeps its own cache:
        :func:`release_host_cache` then returns it to the system (on CUDA, a wait for the
        device), and the budget counts the bytes free from then on.
        """
        with self._lock:
            self._drain()
            freed = self._stats.cached_bytes
            self._stats.pooled_bytes -= freed
            self._stats.cached_bytes = 0
            self._free.clear()
            self._by_size.clear()
        if freed and self.pin:
            release_host_cache()
        return freed
