"""The simulated device's caching allocator: CUDA's ``CUDACachingAllocator``, modelled.

One :class:`CachingAllocator` per device owns its pools, its pending frees and its
statistics; it is plain Python over integers (sizes, addresses, stream ids) and knows the
device only through :class:`Events`, the three things it asks of streams (record an
event, query it, wait for it). The simulated device (``device.py``) routes every device
storage through it: allocated on the stream current at allocation, freed when the
storage dies, ``record_stream`` recorded. What ``torch.cuda.memory_allocated`` /
``memory_reserved`` / ``memory_stats`` would say on a GPU for the same sequence of
allocations, frees and stream uses is what the simulated device says.

**Modelled** (PyTorch's rules, read from ``c10/cuda/CUDACachingAllocator.cpp``):

* *Rounding*: a request is rounded up to a multiple of 512 B (``kMinBlockSize``);
  ``roundup_power2_divisions`` is not set.
* *Two pools*: requests up to 1 MiB (``kSmallSize``) come from the small pool, whose
  segments are 2 MiB (``kSmallBuffer``); larger ones from the large pool, whose new
  segments are 20 MiB (``kLargeBuffer``) for requests under 10 MiB (``kMinLargeAlloc``)
  and the request rounded up to 2 MiB (``kRoundLarge``) above.
* *Per-stream pools*: a free block is handed out only to an allocation on the stream it
  was first allocated on (the pools are ordered by stream, then size, then address).
* *Best fit, splitting and merging*: the smallest free block of the stream that fits is
  taken; it is split when the remainder is at least 512 B (small pool) or more than 1 MiB
  (large pool), else handed out whole (the allocated count includes the slack). A freed
  block merges with free neighbours of its segment.
* *record_stream*: a block freed after ``record_stream(s)`` on streams other than its own
  leaves the allocated count at once, but returns to its pool only once an event recorded
  on each such stream at free time has completed; events are looked at (in order, per
  stream) at the next allocation, as ``process_events`` does. Until then the block is
  *active*, counted in ``active_bytes``, and unusable.
* *Out of memory*: when no free block fits, a new segment is made if the device's
  capacity and the per-process cap (``set_per_process_memory_fraction``; a cap on
  *reserved* memory) allow; else every pending event is waited for, every cached segment
  that is not split is released, and the allocation is tried once more
  (``num_alloc_retries``); if that fails, ``torch.OutOfMemoryError`` is raised with
  CUDA's message (``num_ooms``). ``empty_cache`` is the same release.
* *Statistics*: ``allocated_bytes``, ``reserved_bytes``, ``active_bytes``,
  ``inactive_split_bytes``, ``requested_bytes`` and the counts ``allocation``,
  ``segment``, ``active``, ``inactive_split``, each ``all`` / ``small_pool`` /
  ``large_pool`` with ``current`` / ``peak`` / ``allocated`` / ``freed``;
  ``num_alloc_retries``, ``num_ooms``, ``num_sync_all_streams``, ``num_device_alloc``,
  ``num_device_free``. ``reset_peaks`` resets every peak to its current value.

**Not modelled**: ``max_split_size_mb`` (oversize blocks; so
``release_available_cached_blocks`` never frees a single block first),
``roundup_power2_divisions``, ``garbage_collection_threshold``, expandable segments (one
growing segment per stream), CUDA graphs' private pools, memory other processes or the
CUDA context use (the whole capacity is this process's), the free-memory callbacks,
several devices sharing one allocator, and the cost of ``cudaMalloc`` in time.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

import torch

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
MIN_BLOCK = 512  #: kMinBlockSize: every request is rounded up to a multiple of it
SMALL_SIZE = 1 * MiB  #: kSmallSize: the largest request the small pool serves
SMALL_BUFFER = 2 * MiB  #: kSmallBuffer: a small pool's segment
MIN_LARGE_ALLOC = 10 * MiB  #: kMinLargeAlloc: below it, a large request gets a 20 MiB segment
LARGE_BUFFER = 20 * MiB  #: kLargeBuffer
ROUND_LARGE = 2 * MiB  #: kRoundLarge: larger requests' segments are rounded up to it
#: the default capacity of a simulated device: an 80 GB H100's
CAPACITY = 80 * GiB

STATS = (
    "allocation", "segment", "active", "inactive_split",
    "allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes",
    "requested_bytes",
)  # fmt: skip
COUNTERS = (
    "num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
    "num_device_free",
)  # fmt: skip
POOLS = ("all", "small_pool", "large_pool")


def round_size(nbytes: int) -> int:
    """The bytes a request of ``nbytes`` takes (``round_size``)."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """The segment made for a rounded request of ``size`` no cached block fits
    (``get_allocation_size``)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def format_size(nbytes: int) -> str:
    """Bytes as CUDA's messages write them (``c10::CachingAllocator::format_size``)."""
    if nbytes <= KiB:
        return f"{nbytes} bytes"
    if nbytes <= MiB:
        return f"{nbytes / KiB:.2f} KiB"
    if nbytes <= GiB:
        return f"{nbytes / MiB:.2f} MiB"
    return f"{nbytes / GiB:.2f} GiB"


class Events(Protocol):
    """What the allocator asks of the device's streams (its own events, invisible to the
    program, as the CUDA allocator's event pool is)."""

    def record(self, stream: int) -> Any:
        """An event recorded now on ``stream``: it completes when the work issued to
        ``stream`` so far has ended."""

    def query(self, event: Any) -> bool:
        """Whether ``event`` has completed (the host does not wait)."""

    def synchronize(self, event: Any) -> None:
        """The host waits for ``event``."""


class Block:
    """A range of a segment: allocated, pending (freed, waiting for events), or free in
    its pool. ``prev`` / ``next`` are its neighbours in the segment."""

    __slots__ = ("address", "allocated", "events", "next", "prev", "requested", "size",
                 "small", "stream", "uses")  # fmt: skip

    def __init__(self, stream: int, size: int, address: int, small: bool) -> None:
        self.stream = stream  # the stream it was allocated on: its pool
        self.size = size
        self.address = address
        self.small = small
        self.allocated = False
        self.requested = 0  # the bytes asked for (before rounding)
        self.prev: Block | None = None
        self.next: Block | None = None
        self.uses: set[int] = set()  # streams recorded with record_stream
        self.events = 0  # events still pending since it was freed

    @property
    def split(self) -> bool:
        return self.prev is not None or self.next is not None

    @property
    def free(self) -> bool:
        """In its pool: neither allocated nor waiting for events."""
        return not self.allocated and self.events == 0 and not self.uses

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "pending" if self.events else "free"
        return f"Block({state}, {self.size} B at {self.address:#x}, stream {self.stream})"


class Stat:
    """One statistic: its current value, its peak, and totals added and removed."""

    __slots__ = ("allocated", "current", "freed", "peak")

    def __init__(self) -> None:
        self.current = self.peak = self.allocated = self.freed = 0

    def add(self, amount: int) -> None:
        self.current += amount
        self.allocated += amount
        if self.current > self.peak:
            self.peak = self.current

    def sub(self, amount: int) -> None:
        self.current -= amount
        self.freed += amount


class _Pool:
    """Free blocks of one pool (small or large), per stream, ordered by (size, address)."""

    def __init__(self) -> None:
        self.free: dict[int, list[tuple[int, int, Block]]] = {}

    def insert(self, block: Block) -> None:
        bisect.insort(self.free.setdefault(block.stream, []), (block.size, block.address, block))

    def remove(self, block: Block) -> None:
        blocks = self.free[block.stream]
        i = bisect.bisect_left(blocks, (block.size, block.address))
        del blocks[i]

    def best_fit(self, stream: int, size: int) -> Block | None:
        """The smallest free block of ``stream`` of at least ``size`` bytes, taken out."""
        blocks = self.free.get(stream)
        if not blocks:
            return None
        i = bisect.bisect_left(blocks, (size, -1))
        if i == len(blocks):
            return None
        return blocks.pop(i)[2]

    def blocks(self) -> Iterator[Block]:
        for blocks in self.free.values():
            for _, _, block in blocks:
                yield block


class CachingAllocator:
    """One device's caching allocator (see the module docstring for what it models).

    Keeps: segments (reserved memory) until :meth:`empty_cache` or an out-of-memory retry
    releases the unsplit free ones; freed blocks in their stream's pool; blocks freed
    after ``record_stream`` pending until their events complete; the statistics until
    the allocator is dropped (peaks until :meth:`reset_peaks`).
    """

    def __init__(self, events: Events, *, capacity: int = CAPACITY, name: str = "sim:0") -> None:
        self.events = events
        self.name = name
        self.capacity = capacity
        #: the per-process cap on reserved bytes (``set_per_process_memory_fraction``)
        self.limit: int | None = None
        self._pools = {True: _Pool(), False: _Pool()}  # small?
        self._pending: dict[int, deque[tuple[Any, Block]]] = {}  # stream -> events
        self._addresses = itertools.count(1 << 32, 1 << 32)  # a segment's base
        self._stats = {(s, p): Stat() for s in STATS for p in POOLS}
        self.counters = dict.fromkeys(COUNTERS, 0)
        # A free that arrives while the allocator is changing its pools (the cyclic
        # collector finalizing a storage inside ``malloc``) waits for it to finish.
        self._busy = False
        self._deferred: list[Block] = []

    # -- what torch.cuda reports -----------------------------------------------------------

    @property
    def allocated(self) -> int:
        """``memory_allocated``: bytes of the blocks handed out (rounded sizes)."""
        return self._stats["allocated_bytes", "all"].current

    @property
    def reserved(self) -> int:
        """``memory_reserved``: bytes of the segments held, allocated or cached."""
        return self._stats["reserved_bytes", "all"].current

    @property
    def max_allocated(self) -> int:
        return self._stats["allocated_bytes", "all"].peak

    @property
    def max_reserved(self) -> int:
        return self._stats["reserved_bytes", "all"].peak

    def stat(self, name: str, pool: str = "all") -> Stat:
        return self._stats[name, pool]

    def memory_stats(self) -> dict[str, int]:
        """``torch.cuda.memory_stats()``'s keys for what is modelled, sorted."""
        out = dict(self.counters)
        for (name, pool), stat in self._stats.items():
            for field in Stat.__slots__:
                out[f"{name}.{pool}.{field}"] = getattr(stat, field)
        return dict(sorted(out.items()))

    def reset_peaks(self) -> None:
        """``reset_peak_memory_stats``: every peak becomes its current value."""
        for stat in self._stats.values():
            stat.peak = stat.current

    def reset_accumulated(self) -> None:
        """``reset_accumulated_memory_stats``: the added / removed totals and counters."""
        for stat in self._stats.values():
            stat.allocated = stat.freed = 0
        self.counters = dict.fromkeys(COUNTERS, 0)

    def set_memory_fraction(self, fraction: float) -> None:
        """Cap reserved memory at ``fraction`` of the capacity."""
        if not 0 <= fraction <= 1:
            raise ValueError(
                f"set_per_process_memory_fraction(fraction={fraction!r}): "
                "expected a number in [0, 1]"
            )
        self.limit = int(fraction * self.capacity)

    # -- allocation --------------------------------------------------------------------------

    def malloc(self, nbytes: int, stream: int) -> Block:
        """A block of at least ``nbytes`` for use on ``stream``."""
        self._busy = True
        try:
            return self._malloc(nbytes, stream)
        finally:
            self._done()

    def _malloc(self, nbytes: int, stream: int) -> Block:
        self._process_events()
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._pools[small]
        block = pool.best_fit(stream, size)
        if block is None:
            alloc = segment_size(size)
            block = self._new_segment(stream, alloc, small)
            if block is None:
                self._release_cached()
                self.counters["num_alloc_retries"] += 1
                block = self._new_segment(stream, alloc, small)
            if block is None:
                self.counters["num_ooms"] += 1
                raise torch.OutOfMemoryError(self._oom_message(alloc))
        elif block.split:
            self._add(small, "inactive_split", -1)
            self._add(small, "inactive_split_bytes", -block.size)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = Block(stream, remaining, block.address + size, small)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            pool.insert(rest)
            self._add(small, "inactive_split", 1)
            self._add(small, "inactive_split_bytes", remaining)
        block.allocated = True
        block.requested = nbytes
        for name, amount in (("allocation", 1), ("allocated_bytes", block.size),
                             ("active", 1), ("active_bytes", block.size),
                             ("requested_bytes", nbytes)):  # fmt: skip
            self._add(small, name, amount)
        return block

    def record_stream(self, block: Block, stream: int) -> None:
        """``tensor.record_stream(stream)``: ``block`` is in use on ``stream`` too (uses on
        its own stream need nothing)."""
        if stream != block.stream:
            block.uses.add(stream)

    def free(self, block: Block) -> None:
        """The block's tensor is gone: to its pool now, or once the streams it was
        recorded on have passed the point they reached now."""
        if self._busy:
            self._deferred.append(block)
            return
        self._busy = True
        try:
            self._free(block)
        finally:
            self._done()

    def empty_cache(self) -> None:
        """Wait for the pending frees, then release every cached segment not split."""
        self._busy = True
        try:
            self._release_cached()
        finally:
            self._done()

    def _done(self) -> None:
        while self._deferred:
            self._free(self._deferred.pop())
        self._busy = False

    def _free(self, block: Block) -> None:
        block.allocated = False
        self._add(block.small, "allocation", -1)
        self._add(block.small, "allocated_bytes", -block.size)
        if not block.uses:
            self._free_block(block)
            return
        for stream in sorted(block.uses):
            self._pending.setdefault(stream, deque()).append((self.events.record(stream), block))
            block.events += 1
        block.uses = set()

    # -- the rules --------------------------------------------------------------------------

    def _add(self, small: bool, name: str, amount: int) -> None:
        for pool in ("all", "small_pool" if small else "large_pool"):
            stat = self._stats[name, pool]
            if amount >= 0:
                stat.add(amount)
            else:
                stat.sub(-amount)

    def _new_segment(self, stream: int, size: int, small: bool) -> Block | None:
        if self.limit is not None and self.reserved + size > self.limit:
            return None
        if self.reserved + size > self.capacity:
            return None
        block = Block(stream, size, next(self._addresses), small)
        self._add(small, "segment", 1)
        self._add(small, "reserved_bytes", size)
        self.counters["num_device_alloc"] += 1
        return block

    def _free_block(self, block: Block) -> None:
        """Back into its pool, merged with free neighbours (``free_block``)."""
        size, small, pool = block.size, block.small, self._pools[block.small]
        split_blocks, split_bytes = 0, 0
        for neighbour in (block.prev, block.next):
            if neighbour is None or not neighbour.free:
                continue
            pool.remove(neighbour)
            if neighbour is block.prev:
                block.address, block.prev = neighbour.address, neighbour.prev
                if block.prev is not None:
                    block.prev.next = block
            else:
                block.next = neighbour.next
                if block.next is not None:
                    block.next.prev = block
            block.size += neighbour.size
            split_blocks, split_bytes = split_blocks - 1, split_bytes - neighbour.size
        pool.insert(block)
        if block.split:
            split_blocks, split_bytes = split_blocks + 1, split_bytes + block.size
        self._add(small, "inactive_split", split_blocks)
        self._add(small, "inactive_split_bytes", split_bytes)
        self._add(small, "active", -1)
        self._add(small, "active_bytes", -size)
        self._add(small, "requested_bytes", -block.requested)
        block.requested = 0

    def _process_events(self) -> None:
        """Pending frees whose events have completed go to their pools (in order, per
        stream: a stream's first incomplete event stops its queue)."""
        for stream, queue in list(self._pending.items()):
            while queue and self.events.query(queue[0][0]):
                self._event_done(queue.popleft()[1])
            if not queue:
                del self._pending[stream]

    def _event_done(self, block: Block) -> None:
        block.events -= 1
        if block.events == 0:
            self._free_block(block)

    def _release_cached(self) -> None:
        """Wait for every pending event, then release the cached segments that are not
        split (``release_cached_blocks``)."""
        self.counters["num_sync_all_streams"] += 1
        for queue in self._pending.values():
            for event, block in queue:
                self.events.synchronize(event)
                self._event_done(block)
        self._pending.clear()
        for small, pool in self._pools.items():
            for block in [b for b in pool.blocks() if not b.split]:
                pool.remove(block)
                self._add(small, "segment", -1)
                self._add(small, "reserved_bytes", -block.size)
                self.counters["num_device_free"] += 1

    def _oom_message(self, alloc: int) -> str:
        allowed = f"{format_size(self.limit)} allowed; " if self.limit is not None else ""
        return (
            f"{self.name.split(':')[0].upper()} out of memory. Tried to allocate "
            f"{format_size(alloc)}. Device {self.name} has a total capacity of "
            f"{format_size(self.capacity)} of which "
            f"{format_size(self.capacity - self.reserved)} is free. {allowed}"
            f"Of the allocated memory {format_size(self.allocated)} is allocated by "
            f"PyTorch, and {format_size(self.reserved - self.allocated)} is reserved by "
            "PyTorch but unallocated. If reserved but unallocated memory is large try "
            "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
            "fragmentation."
        )

    # -- checking ------------------------------------------------------------------------

    def check(self, live: list[Block] | None = None) -> None:
        """Raise AssertionError unless the pools agree with the statistics: free blocks
        are free, reserved >= active >= allocated, and (given the ``live`` blocks, every
        block handed out and not freed) allocated is their sum."""
        free = [b for pool in self._pools.values() for b in pool.blocks()]
        assert all(b.free for b in free), free
        cached = sum(b.size for b in free)
        pending = {id(b): b for q in self._pending.values() for _, b in q}
        assert all(b.events > 0 and not b.allocated for b in pending.values())
        reserved, allocated = self.reserved, self.allocated
        active = self._stats["active_bytes", "all"].current
        assert reserved >= active >= allocated >= 0, (reserved, active, allocated)
        assert active == reserved - cached, (active, reserved, cached)
        assert active - allocated == sum(b.size for b in pending.values())
        if live is not None:
            assert allocated == sum(b.size for b in live), (allocated, live)
