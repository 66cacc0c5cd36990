"""Activation offloading whose payloads the autograd graph owns.

``OffloadActivations`` moves the tensors autograd saves for backward to host memory during
forward and brings them back in backward, optionally on a side stream. It is a drop-in for
TRL's / torchtune's class of the same name (same constructor, ``update_model_params``),
built the other way round: the pack hook returns a handle object, and that handle owns
the host copy (and, while a copy is in flight, the device tensor and its event). The
autograd graph owns the handle. So:

* a graph that is dropped without backward frees its payloads with it;
* two forwards under separate ``with`` blocks, then one backward, just work (nothing is
  wiped on ``__enter__``: there is no table to wipe);
* ``backward(retain_graph=True)`` twice works: unpack reads the handle, never consumes it;
* nothing per-step lives in the context manager: it keeps a pool of *free* host blocks
  (bounded by a byte budget), weak references to the handles whose copies are in flight,
  and configuration.

Lifetime contract
-----------------
*A handle* lives exactly as long as autograd keeps the saved tensor: until the node's
backward has run in a pass that does not keep the graph, or until the graph is dropped.
Its host block returns to the pool then.
*The device tensor* of an offloaded activation is kept only while its device-to-host copy
is in flight: at most ``max_fwd_stash_size`` of them per context, and none after
``__exit__``.
*A restored (device) copy* belongs to autograd, which drops it after the node's backward;
views of one storage restored while a sibling copy is alive share it.
*What a graph keeps*: its handles, their host copies (the pool blocks holding its bytes)
and its ``with`` block's pack order. Never the context manager nor its pool: both are
referenced weakly. Drop the manager while a graph lives and that graph's backward still
restores its bytes (a synchronous copy, without prefetch); the blocks are freed rather
than returned to a pool that is gone.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import warnings
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.hooks import RemovableHandle

from leakfree._warnings import LeakfreeWarning

__all__ = [
    "PROCESS_BUDGET",
    "HostBlockPool",
    "HostBudget",
    "NoOffload",
    "OffloadActivations",
    "OffloadWarning",
    "offload_model",
    "remove_offload_hooks",
]


class OffloadWarning(LeakfreeWarning):
    """Something about offloading that costs speed or memory (never correctness)."""


# --- host memory ---------------------------------------------------------------------------


def _size_class(nbytes: int) -> int:
    """Pool blocks come in size classes: powers of two, from 4 KiB.

    PyTorch's caching host allocator rounds every pinned allocation up to a power of two,
    so a block of a size class pins exactly its size: the budget counts real bytes.
    """
    return 1 << max(12, math.ceil(math.log2(max(nbytes, 1))))


def _default_budget() -> int:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover  (non-POSIX)
        total = 16 << 30
    return int(total // 4)


class HostBudget:
    """Bytes of pooled host blocks that may exist at once, for one or several pools.

    A block reserves its size when it is created within the budget and gives it back when
    it is freed (its finalizer queues the bytes; never a lock there, as it may run inside
    a garbage collection). :data:`PROCESS_BUDGET` is the default of every pool: one
    budget per process, however many managers (one per model, one per data loader...).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used = 0
        self._freed: deque[int] = deque()
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        with self._lock:
            return self._settle()

    def _settle(self) -> int:
        while self._freed:
            self._used -= self._freed.popleft()
        return self._used

    def try_reserve(self, nbytes: int) -> bool:
        with self._lock:
            if self._settle() + nbytes > self.limit:
                return False
            self._used += nbytes
            return True

    def give_back(self, nbytes: int) -> None:
        self._freed.append(nbytes)  # atomic: safe from a finalizer


#: The budget every pool shares unless given its own: a quarter of physical memory.
PROCESS_BUDGET = HostBudget(_default_budget())


class HostBlock:
    """One host buffer (a 1-D ``uint8`` tensor) from a :class:`HostBlockPool`.

    ``event`` is the last device event that reads or writes it; the pool does not hand the
    block out again before that event has completed.
    """

    __slots__ = ("__weakref__", "budget", "data", "event", "pinned", "pooled", "size")

    def __init__(self, size: int, pinned: bool, budget: HostBudget | None = None) -> None:
        self.size = size
        self.pinned = pinned
        self.pooled = budget is not None
        self.budget = budget  # the budget this block's bytes are reserved in, if any
        self.data = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        self.event: Any = None

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def __del__(self) -> None:
        budget = getattr(self, "budget", None)
        if budget is not None:
            budget.give_back(self.size)


@dataclass
class PoolStats:
    """Byte and event counts of a :class:`HostBlockPool` (sizes are size classes)."""

    in_use_bytes: int = 0  #: held by live host copies
    cached_bytes: int = 0  #: free blocks kept for reuse
    pooled_bytes: int = 0  #: in use + cached, of blocks within the budget
    allocations: int = 0  #: new blocks within the budget
    reuses: int = 0  #: acquires served from the cache
    overflows: int = 0  #: new blocks beyond the budget (pageable, freed on release)


class HostBlockPool:
    """Reusable host blocks up to a byte budget, pinned when ``pin``.

    ``acquire(n)`` returns a block of at least ``n`` bytes: a cached block of the same size
    class whose last copy has completed (waiting for the oldest one if all are busy), else
    a new one. New blocks join the pool while ``pooled_bytes`` stays within ``budget``,
    evicting cached blocks of other size classes (least recently used first) to make room;
    beyond it they are pageable "overflow" blocks, freed again on release (with ``pin``,
    copies to them are synchronous: an :class:`OffloadWarning` is issued once).

    ``release`` never blocks and never allocates (it runs from the finalizers of host
    copies, possibly inside a garbage collection triggered while the pool is busy): it
    queues the block, and the next ``acquire``, ``trim`` or ``stats`` read takes it back.
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
            if block.pooled and reuse:
                self._free[id(block)] = block
                self._by_size.setdefault(block.size, {})[id(block)] = block
                self._stats.cached_bytes += block.size
            elif block.pooled:  # its memory lives on in views: it leaves the pool
                self._stats.pooled_bytes -= block.size

    def acquire(self, nbytes: int) -> HostBlock:
        size = _size_class(nbytes)
        wait: HostBlock | None = None
        with self._lock:
            self._drain()
            same = self._by_size.get(size)
            block = next((b for b in same.values() if b.ready()), None) if same else None
            if block is None and same and self.host_budget.used + size > self.budget:
                block = wait = next(iter(same.values()))  # all busy, no room: wait for one
            if block is not None:
                self._take(block)
                self._stats.cached_bytes -= size
                self._stats.in_use_bytes += size
                self._stats.reuses += 1
            else:
                self._evict_for(size)
                pooled = self.host_budget.try_reserve(size)
                self._stats.in_use_bytes += size
                if pooled:
                    self._stats.pooled_bytes += size
                    self._stats.allocations += 1
                else:
                    self._stats.overflows += 1
                warn = not pooled and self.pin and not self._warned
                self._warned = self._warned or warn
        if wait is not None:
            wait.event.synchronize()  # outside the lock
            return wait
        if block is not None:
            return block
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
            if pooled:
                self.host_budget.give_back(size)
            raise

    def _evict_for(self, size: int) -> None:
        """Free ready cached blocks (least recently used first) until ``size`` fits."""
        for key in list(self._free):
            if self.host_budget.used + size <= self.budget:
                return
            if self._free[key].ready():
                block = self._free[key]
                self._take(block)
                self._stats.cached_bytes -= block.size
                self._stats.pooled_bytes -= block.size
                del block  # its finalizer gives its bytes back to the budget

    def _take(self, block: HostBlock) -> None:
        """Remove a free block from the free lists (lock held)."""
        del self._free[id(block)]
        del self._by_size[block.size][id(block)]

    def release(self, block: HostBlock, *, reuse: bool = True) -> None:
        """Give ``block`` back (``reuse=False``: its memory is still viewed elsewhere, so
        it leaves the pool instead of being handed out again)."""
        self._returned.append((block, reuse))

    def trim(self) -> int:
        """Free every cached block; returns the bytes freed.

        Pinned memory goes back to PyTorch's host allocator, which keeps its own cache;
        ``torch._C._host_emptyCache()`` (where it exists) is called to return it to the OS.
        """
        with self._lock:
            self._drain()
            freed = self._stats.cached_bytes
            self._stats.pooled_bytes -= freed
            self._stats.cached_bytes = 0
            self._free.clear()
            self._by_size.clear()
        empty = getattr(torch._C, "_host_emptyCache", None)
        if freed and self.pin and empty is not None:
            empty()
        return freed


# --- what the graph owns ---------------------------------------------------------------------


def _span(t: torch.Tensor) -> tuple[int, int]:
    """First and one-past-last element index of ``t`` in its storage (in elements)."""
    offset = int(t.storage_offset())
    if t.is_contiguous():  # the common case, without a walk over the strides
        return offset, offset + t.numel()
    if t.numel() == 0:
        return offset, offset
    last = offset + sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride()))
    return offset, last + 1


def _version_error(t_version: int, saved_version: int, shape: Any) -> RuntimeError:
    # The check PyTorch makes for saved tensors, which it skips whenever saved-tensor
    # hooks are installed: made here so hooks do not hide in-place bugs.
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: a saved tensor of shape {list(shape)} is at version "
        f"{t_version}; expected version {saved_version} instead (checked by leakfree, "
        "because PyTorch does not check tensors that pass through saved-tensor hooks)"
    )


class _Kept:
    """A saved tensor that stays where it is: detached, with its version at save time.

    Detached because a saved *output* reaches the pack hook with ``grad_fn`` set to the very
    node that saves it: storing it as is closes a cycle through C++ (node -> saved tensor
    -> grad_fn -> node) that no garbage collector can free, so a graph dropped without
    backward would leak with everything upstream of it. Autograd restores the autograd
    metadata on unpack itself.
    """

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t.detach()  # shares storage and version counter, holds no grad_fn
        self.version = t._version

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        if t._version != self.version:
            raise _version_error(t._version, self.version, t.shape)
        return t


class _HostCopy:
    """Host bytes of (a span of) one device storage, shared by the handles that use them.

    Returns its pool block when the last handle using it dies.
    """

    __slots__ = (
        "__weakref__",
        "block",
        "byte_start",
        "device",
        "host",
        "index",
        "lent",
        "nbytes",
        "pool",
        "prefetched",
        "restored",
        "source",
    )

    def __init__(
        self, pool: HostBlockPool, nbytes: int, byte_start: int, device: torch.device
    ) -> None:
        # Weak: a graph keeps its own host bytes, not the pool and its free blocks.
        self.pool = weakref.ref(pool)
        self.block = pool.acquire(nbytes)
        data = self.block.data
        self.host = data if nbytes == self.block.size else data[:nbytes]  # the bytes used
        self.nbytes = nbytes
        self.byte_start = byte_start  # where the copied bytes start in the source storage
        self.device = device
        self.index = 0  # tape position of the newest handle using it
        self.lent = False  # restored tensors view the block itself (CPU): never reuse it
        self.source: Any = None  # weak reference to the source storage (dedup validity)
        #: (weak reference to a live restored storage, the event its copy-in recorded)
        self.restored: tuple[Any, Any] | None = None
        self.prefetched: tuple[torch.Tensor, Any] | None = None  # (device bytes, event)

    def host_bytes(self) -> torch.Tensor:
        return self.host

    def live_restored(self) -> tuple[torch.UntypedStorage, Any] | None:
        """The device storage a sibling handle restored, if it is still alive, and the
        event its copy-in recorded."""
        if self.restored is None:
            return None
        alive = self.restored[0]()
        return None if alive is None else (alive, self.restored[1])

    def __del__(self) -> None:
        block = getattr(self, "block", None)
        pool = self.pool() if block is not None else None
        if block is not None and pool is not None:
            # never blocks: safe inside a garbage collection
            pool.release(block, reuse=not self.lent)
        # (pool gone: the block's memory is freed with it)


class _Offloaded:
    """The packed form of one saved tensor: the graph owns it, and it owns everything."""

    __slots__ = (
        "__weakref__",
        "copy",
        "dtype",
        "element_offset",
        "in_flight",
        "index",
        "manager",
        "session",
        "shape",
        "stride",
        "version",
    )

    def __init__(
        self,
        manager: OffloadActivations,
        session: _Session,
        copy: _HostCopy,
        t: torch.Tensor,
        element_offset: int,
    ) -> None:
        # Weak, like the hooks: a graph keeps its payloads, never the context manager.
        self.manager = weakref.ref(manager)
        self.session = session
        self.index = session.next_index()  # position in pack order
        self.copy = copy
        copy.index = self.index
        self.dtype = t.dtype
        self.shape = t.shape
        self.stride = t.stride()
        self.version = t._version
        self.element_offset = element_offset  # storage offset within the copied bytes
        #: the device tensor (detached) while its device-to-host copy is in flight
        self.in_flight: torch.Tensor | None = None

    def unpack(self) -> torch.Tensor:
        t = self.in_flight
        if t is not None:  # never left the device: its copy has not even retired
            if t._version != self.version:
                raise _version_error(t._version, self.version, t.shape)
            return t
        manager = self.manager()
        if manager is not None:
            storage = manager._restore(self.copy, self.session)
        else:
            storage = _restore_without_manager(self.copy)
        out = torch.empty(0, dtype=self.dtype, device=self.copy.device)
        out.set_(storage, self.element_offset, self.shape, self.stride)
        if manager is not None and manager.use_streams:
            manager._unpack_prefetch(self)
        return out


_orphan_lock = threading.Lock()


def _restore_without_manager(copy: _HostCopy) -> torch.UntypedStorage:
    """The context manager was dropped while its graph lived on: bring the bytes back with
    a plain synchronous copy on the current stream (its copies out all completed by its
    ``__exit__``; no prefetch is left to use)."""
    with _orphan_lock:
        sibling = copy.live_restored()
        if sibling is not None:
            return sibling[0]
        dev = torch.empty(copy.nbytes, dtype=torch.uint8, device=copy.device)
        dev.copy_(copy.host_bytes())
        storage = dev.untyped_storage()
        copy.restored = (weakref.ref(storage), None)
        return storage


# --- the context managers ---------------------------------------------------------------------


class _Session:
    """One ``with`` block's pack order (for prefetch) and storage dedup map.

    Holds handles and host copies weakly: it owns no payload. The tape drops its dead
    prefix as it grows, so one ``with`` around a whole training loop stays cheap.
    """

    __slots__ = ("__weakref__", "base", "prefetching", "shared", "tape")

    def __init__(self) -> None:
        self.tape: deque[weakref.ref[_Offloaded]] = deque()
        self.base = 0  # pack index of tape[0]
        #: (storage address, version) -> the host copy made of it (weakly); one forward's
        #: worth of entries, dropped with the session
        self.shared: dict[tuple[int, int], weakref.ref[_HostCopy]] = {}
        #: copies with a prefetched device copy not yet consumed, weakly, in plan order
        self.prefetching: deque[weakref.ref[_HostCopy]] = deque()

    def next_index(self) -> int:
        return self.base + len(self.tape)

    def append(self, handle: _Offloaded) -> None:
        self.tape.append(weakref.ref(handle))
        if len(self.tape) >= 2048 and self.tape[0]() is None:
            while self.tape and self.tape[0]() is None:  # a dead prefix: earlier steps
                self.tape.popleft()
                self.base += 1

    def handle_at(self, index: int) -> _Offloaded | None:
        i = index - self.base
        return self.tape[i]() if 0 <= i < len(self.tape) else None


def _accelerator() -> torch.device | None:
    if not torch.accelerator.is_available():
        return None
    return torch.accelerator.current_accelerator()


def _pack_hook(manager_ref: weakref.ref[OffloadActivations]) -> Callable[[torch.Tensor], Any]:
    # Module-level closures over a weak reference: hooks bound to the instance would make
    # every OffloadActivations a reference cycle (and its pinned pool gc-only).
    def pack(t: torch.Tensor) -> Any:
        manager = manager_ref()
        return _Kept(t) if manager is None else manager._pack(t)

    return pack


def _unpack_hook(packed: Any) -> torch.Tensor:
    out: torch.Tensor = packed.unpack()
    return out


class OffloadActivations(saved_tensors_hooks):
    """Offload activations saved for backward to host memory; the graph owns every payload.

    Args (the first four as TRL's ``OffloadActivations``):
        use_pin_memory: copy into pinned host memory (from a reusable pool) so copies can be
            asynchronous.
        use_streams: on an accelerator, copy on a side stream that overlaps with compute:
            device-to-host in forward, host-to-device prefetch in backward.
        min_offload_size: tensors smaller than this many bytes stay where they are.
        max_fwd_stash_size: how many device-to-host copies may be in flight at once (their
            device tensors are kept alive until then), and how many host-to-device copies
            backward prefetches ahead. At least 1.
        device: the device to offload from; by default the current accelerator. Tensors on
            other device types stay put.
        force_host_copy: on a machine without an accelerator, offload CPU tensors to
            separate host buffers and back, so the whole path (handles, pool, dedup,
            lifetimes) runs and is tested on CPU. Without it, on such a machine, nothing is
            offloaded and the context is a cheap no-op.
        pin_memory_budget: bytes of pinned host memory the pool may hold (in use plus
            cached, counted as PyTorch's pinned allocator rounds them: powers of two);
            beyond it copies use pageable memory. Default (None): one budget for the
            whole process, a quarter of RAM, shared by every manager that does not set
            its own (``leakfree.offload.PROCESS_BUDGET``).

    Parameters, views of parameters, what ``update_model_params`` registered (matched by
    storage address: call it again after moving the model), tensor subclasses, non-strided
    layouts and tensors with lazy conj/neg bits are never offloaded. Several views of one
    storage are copied once and restored as views of one storage again. Restored tensors
    have the original shape and strides (and storage offset, for whole-storage copies), so
    gradients are bit-identical. In-place changes to a saved tensor are reported as PyTorch
    reports them while the tensor is still on the device (kept, or its copy in flight).

    ``__exit__`` makes each compute stream wait for its side stream and drops every device
    tensor kept for an in-flight copy, in ``finally``, so the hooks are always popped.
    """

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        min_offload_size: int = 1024,
        max_fwd_stash_size: int = 5,
        *,
        device: torch.device | str | None = None,
        force_host_copy: bool = False,
        pin_memory_budget: int | None = None,
    ) -> None:
        if not isinstance(max_fwd_stash_size, int) or max_fwd_stash_size < 1:
            raise ValueError(
                f"OffloadActivations(max_fwd_stash_size={max_fwd_stash_size!r}): must be an "
                "int >= 1 (the number of copies in flight at once)"
            )
        if not isinstance(min_offload_size, int) or min_offload_size < 0:
            raise ValueError(
                f"OffloadActivations(min_offload_size={min_offload_size!r}): must be an int "
                ">= 0 (bytes)"
            )
        target = torch.device(device) if device is not None else _accelerator()
        if target is None and force_host_copy:
            target = torch.device("cpu")
        if target is not None and target.type == "cpu" and not force_host_copy:
            raise ValueError(
                "OffloadActivations(device='cpu'): offloading CPU tensors to CPU only makes "
                "sense to exercise the path; pass force_host_copy=True for that"
            )
        self.device: torch.device | None = target
        accelerated = target is not None and target.type != "cpu"
        self.use_streams = bool(use_streams) and accelerated
        self.use_pin_memory = bool(use_pin_memory) and accelerated
        self.min_offload_size = min_offload_size
        self.max_fwd_stash_size = max_fwd_stash_size
        self._device_type = target.type if target is not None else None
        self.pool = HostBlockPool(pin_memory_budget, pin=self.use_pin_memory)
        self._device_module: Any = (
            torch.get_device_module(target.type) if accelerated and target is not None else None
        )
        self._side_streams: dict[int, Any] = {}  # device index -> side stream
        self._param_storages: frozenset[int] = frozenset()
        self._session = _Session()
        self._depth = 0
        self._in_flight: deque[weakref.ref[_Offloaded]] = deque()
        self._lock = threading.RLock()  # backward may unpack on several device threads
        self.enabled = target is not None
        super().__init__(_pack_hook(weakref.ref(self)), _unpack_hook)

    # -- configuration ------------------------------------------------------------------

    @property
    def min_offload_size(self) -> int:
        """Tensors smaller than this many bytes stay where they are (settable)."""
        return self._min_offload_size

    @min_offload_size.setter
    def min_offload_size(self, value: int) -> None:
        self._min_offload_size = value
        self._min_bytes = max(value, 1)  # what the pack hook compares, precomputed

    def update_model_params(self, model: nn.Module) -> None:
        """Never offload ``model``'s parameters and buffers (matched by storage address).

        Addresses change when the model moves (``.to()``) or its storage is re-created:
        call it again then.
        """
        storages = set()
        for t in [*model.parameters(), *model.buffers()]:
            local = getattr(t, "_local_tensor", t)  # DTensor shards
            try:
                ptr = local.untyped_storage().data_ptr()
            except RuntimeError:
                continue
            if ptr:
                storages.add(ptr)
        self._param_storages = frozenset(storages)

    # -- the hooks --------------------------------------------------------------------------

    def _eligible(self, t: torch.Tensor) -> torch.UntypedStorage | None:
        """``t``'s storage if ``t`` is to be offloaded, else None (cheapest checks first:
        this runs for every saved tensor)."""
        if not (self.enabled and type(t) is torch.Tensor):  # not Parameters, not subclasses
            return None
        if t.is_nested or t.layout != torch.strided or t.is_quantized:
            return None  # no sizes to span, or no byte view to copy through
        if t.nbytes < self._min_bytes or t.device.type != self._device_type:
            return None
        if t.is_conj() or t.is_neg() or isinstance(t._base, nn.Parameter):
            return None  # lazy bits; weight.t() and other parameter views
        storage = t.untyped_storage()
        return None if storage.data_ptr() in self._param_storages else storage

    def _pack(self, t: torch.Tensor) -> Any:
        storage = self._eligible(t)
        if storage is None:
            return _Kept(t)  # stays where it is, as plain PyTorch would keep it
        elem = t.element_size()
        first, end = _span(t)
        span_bytes = (end - first) * elem
        whole = storage.nbytes() <= 2 * span_bytes
        with self._lock:
            session = self._session
            copy = self._shared_copy(session, storage, t._version) if whole else None
            if copy is None:
                start = 0 if whole else first * elem
                nbytes = storage.nbytes() if whole else span_bytes
                copy = _HostCopy(self.pool, nbytes, start, t.device)
                self._copy_out(t, storage, copy)
                if whole:
                    copy.source = weakref.ref(storage)
                    session.shared[(storage.data_ptr(), t._version)] = weakref.ref(copy)
            offset = int(t.storage_offset()) - copy.byte_start // elem
            handle = _Offloaded(self, session, copy, t, offset)
            session.append(handle)
            if self.use_streams and copy.block.pinned:
                # The device tensor stays alive (owned by the handle, detached: no grad_fn
                # cycle) until its copy retires. Pageable copies are synchronous already.
                handle.in_flight = t.detach()
                for old in _retire(self._in_flight, weakref.ref(handle), self.max_fwd_stash_size):
                    old.in_flight = None  # record_stream(side) keeps its memory safe
        return handle

    # -- copies -----------------------------------------------------------------------------

    def _shared_copy(
        self, session: _Session, storage: torch.UntypedStorage, version: int
    ) -> _HostCopy | None:
        """A host copy of this very storage, at this version, made during this forward.

        Keyed by address and version counter (an in-place write makes a new copy), and
        valid only while the storage it was copied from is alive (an address is reused
        only after its storage died): no stale keys, nothing to clean up. Writes that
        bypass the version counter (through ``.data``, ``set_`` or numpy aliases) between
        two saves are not seen: PyTorch does not track them either.
        """
        ref = session.shared.get((storage.data_ptr(), version))
        copy = ref() if ref is not None else None
        if copy is not None and copy.source is not None and copy.source() is not None:
            return copy
        return None

    def _copy_out(self, t: torch.Tensor, storage: torch.UntypedStorage, copy: _HostCopy) -> None:
        src = torch.empty(0, dtype=torch.uint8, device=t.device)
        src.set_(storage, copy.byte_start, (copy.nbytes,), (1,))
        dst = copy.host_bytes()
        if self._device_module is None:  # force_host_copy on a CPU-only machine
            dst.copy_(src)
            return
        side = self._side(t.device) if self.use_streams else None
        if side is not None:
            compute = self._device_module.current_stream(t.device)
            side.wait_stream(compute)  # the activation is complete before we read it
        with self._device_module.stream(side):  # stream(None): stay on the current one
            dst.copy_(src, non_blocking=copy.block.pinned)
            # the pool hands the block out again only once this copy has completed
            copy.block.event = self._device_module.current_stream(t.device).record_event()
        if side is not None:
            # The allocator must not hand this memory to anyone before the copy ran, even
            # if every reference to it is dropped early (e.g. the graph dies in forward).
            t.record_stream(side)

    def _restore(self, copy: _HostCopy, session: _Session) -> torch.UntypedStorage:
        """A device storage holding ``copy``'s bytes (shared with a live restored sibling)."""
        with self._lock:
            sibling = copy.live_restored()
            if sibling is not None:
                alive, event = sibling
                if event is not None:  # this backward may run on another stream
                    self._use_here(_bytes_of(alive, copy.device), event)
                return alive
            if copy.prefetched is not None:
                dev, event = copy.prefetched
                copy.prefetched = None
                self._use_here(dev, event)
            else:
                dev, event = self._copy_in(copy)
            storage = dev.untyped_storage()
            copy.restored = (weakref.ref(storage), event)
            return storage

    def _copy_in(self, copy: _HostCopy, *, prefetch: bool = False) -> tuple[torch.Tensor, Any]:
        src = copy.host_bytes()
        if self._device_module is None:
            # force_host_copy on a CPU-only machine: the host bytes are already where the
            # tensor lives, so restored tensors view them (no copy back); the block then
            # stays theirs and is never handed out again.
            copy.lent = True
            return src, None
        # No wait for compute: the host bytes were written on this same (side) stream.
        side = self._side(copy.device) if self.use_streams else None
        with self._device_module.stream(side):
            dev = torch.empty(copy.nbytes, dtype=torch.uint8, device=copy.device)
            dev.copy_(src, non_blocking=copy.block.pinned)
            event = self._device_module.current_stream(copy.device).record_event()
        copy.block.event = event  # the host block is read until this completes
        if prefetch:
            copy.prefetched = (dev, event)
        elif side is not None:
            self._use_here(dev, event)
        return dev, event

    def _use_here(self, dev: torch.Tensor, event: Any) -> None:
        """Make ``dev``, written on another stream up to ``event``, usable on the current
        stream: wait for the write, and keep the allocator from reusing the memory before
        this stream is done with it."""
        current = self._device_module.current_stream(dev.device)
        current.wait_event(event)
        dev.record_stream(current)

    def _side(self, device: torch.device) -> Any:
        index = (
            device.index if device.index is not None else torch.accelerator.current_device_index()
        )
        side = self._side_streams.get(index)
        if side is None:
            side = self._side_streams[index] = self._device_module.Stream(device=device)
        return side

    # -- backward prefetch (its decisions are plain Python, tested on CPU) -----------------

    def _unpack_prefetch(self, handle: _Offloaded) -> None:
        with self._lock:
            session = handle.session
            live = _prune_prefetching(session.prefetching, handle.index)
            for copy in _prefetch_plan(session, handle, self.max_fwd_stash_size - live):
                self._copy_in(copy, prefetch=True)
                session.prefetching.append(weakref.ref(copy))

    # -- context ------------------------------------------------------------------------------

    def __enter__(self) -> OffloadActivations:  # type: ignore[override]
        with self._lock:
            if self._depth == 0:
                # A fresh tape and dedup map for this forward; earlier forwards' handles
                # keep their own session. Nested entries of the same instance share it.
                self._session = _Session()
            self._depth += 1
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            with self._lock:
                self._depth -= 1
                if self._device_module is not None:
                    assert self.device is not None
                    for index, side in self._side_streams.items():
                        device = torch.device(self.device.type, index)
                        self._device_module.current_stream(device).wait_stream(side)
                while self._in_flight:
                    handle = self._in_flight.popleft()()
                    if handle is not None:
                        handle.in_flight = None
        finally:
            super().__exit__(*exc)


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _retire(
    window: deque[weakref.ref[_Offloaded]], new: weakref.ref[_Offloaded], limit: int
) -> Iterator[_Offloaded]:
    """Add ``new`` to the in-flight window; yield the handles that must leave it.

    Dead entries (their graph was dropped) leave silently; the oldest live ones leave until
    at most ``limit`` remain.
    """
    window.append(new)
    while len(window) > limit:
        old = window.popleft()()
        if old is not None and old.in_flight is not None:
            yield old


def _prune_prefetching(window: deque[weakref.ref[_HostCopy]], current: int) -> int:
    """Drop prefetches that were consumed, died, or that backward has moved past.

    Backward runs towards lower pack indexes: a prefetched copy whose handles are all at or
    above ``current`` and was not consumed is not going to be (an unused branch, a partial
    ``autograd.grad``); its device copy is dropped. Returns how many are still pending.
    """
    kept: deque[weakref.ref[_HostCopy]] = deque()
    while window:
        ref = window.popleft()
        copy = ref()
        if copy is None or copy.prefetched is None:
            continue
        if copy.index >= current:
            copy.prefetched = None  # stale: free its device memory now
            continue
        kept.append(ref)
    window.extend(kept)
    return len(window)


#: How far back (in pack order) one prefetch plan looks past dead entries.
_PLAN_SCAN = 256


def _prefetch_plan(session: _Session, current: _Offloaded, budget: int) -> list[_HostCopy]:
    """Host copies to bring back ahead of time: those packed just before ``current``.

    Backward runs roughly in reverse pack order, so the tensors saved right before the one
    being unpacked are needed next. Skips what is still on device, already restored or
    prefetched, and handles whose graph is gone; looks at most ``_PLAN_SCAN`` entries back.
    At most ``budget`` copies.
    """
    plan: list[_HostCopy] = []
    if budget <= 0:
        return plan
    seen: set[int] = {id(current.copy)}
    stop = max(session.base, current.index - _PLAN_SCAN)
    for index in range(current.index - 1, stop - 1, -1):
        handle = session.handle_at(index)
        if handle is None or handle.in_flight is not None or id(handle.copy) in seen:
            continue
        copy = handle.copy
        seen.add(id(copy))
        if copy.prefetched is not None or copy.live_restored() is not None:
            continue
        plan.append(copy)
        if len(plan) >= budget:
            break
    return plan


class NoOffload(saved_tensors_hooks):
    """Inside this context, saved tensors stay where they are.

    Use it around parts of the forward whose activations are needed again right away
    (the output head), or that must not move. Nests with :class:`OffloadActivations` and
    with itself: the innermost context decides. Unlike identity hooks it keeps saved tensors
    detached (a saved output with its ``grad_fn`` would be an uncollectable cycle) and
    reports in-place changes to them, as PyTorch does without hooks.
    """

    def __init__(self) -> None:
        super().__init__(_Kept, _unpack_hook)


# --- model helpers ---------------------------------------------------------------------------

_MODEL_HOOKS: weakref.WeakKeyDictionary[nn.Module, list[RemovableHandle]] = (
    weakref.WeakKeyDictionary()
)
_HEAD_NAMES = ("output", "lm_head", "decoder.output", "decoder.lm_head", "head")


def _find_head(model: nn.Module) -> nn.Module | None:
    root = getattr(model, "module", model)  # DDP / FSDP1 wrappers
    if hasattr(root, "base_model") and hasattr(root, "peft_config"):
        root = root.base_model
    for name in _HEAD_NAMES:
        obj: Any = root
        for part in name.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.Module):
            linear = getattr(obj, "linear", None)
            return linear if isinstance(linear, nn.Module) and name == "output" else obj
    for name in ("final_layer_norm", "ln_f"):
        obj = getattr(root, name, None)
        if isinstance(obj, nn.Module):
            return obj
    return None


def offload_model(
    model: nn.Module,
    *,
    head: nn.Module | str | None = None,
    no_offload: Iterable[nn.Module | str] = (),
    warn_if_no_head: bool = True,
    **kwargs: Any,
) -> OffloadActivations:
    """An :class:`OffloadActivations` for ``model``, with its output head kept on device.

    Registers forward hooks that run the head (found as TRL does: ``output``, ``lm_head``,
    ``decoder.output``, ``head``, ``final_layer_norm`` / ``ln_f``; or given as ``head``, a
    module or a dotted name) and the ``no_offload`` modules under :class:`NoOffload`, and
    tells the context about the model's parameters. Calling it again for the same model
    first removes the hooks of the previous call (they never stack);
    :func:`remove_offload_hooks` removes them. ``kwargs`` go to ``OffloadActivations``.
    """
    ctx = OffloadActivations(**kwargs)
    ctx.update_model_params(model)
    remove_offload_hooks(model)
    modules: list[nn.Module] = []
    if head is None:
        found = _find_head(model)
        if found is not None:
            modules.append(found)
        elif warn_if_no_head:
            warnings.warn(
                "offload_model: no output head found (output, lm_head, head, ...); its "
                "activations will be offloaded and brought back at once. Pass head=...",
                OffloadWarning,
                stacklevel=2,
            )
    else:
        modules.append(_resolve(model, head, "head"))
    modules += [_resolve(model, m, "no_offload") for m in no_offload]
    handles: list[RemovableHandle] = []
    for module in modules:
        guard = NoOffload()
        handles.append(module.register_forward_pre_hook(_enter_hook(guard)))
        handles.append(module.register_forward_hook(_exit_hook(guard), always_call=True))
    _MODEL_HOOKS[model] = handles
    return ctx


def remove_offload_hooks(model: nn.Module) -> int:
    """Remove the hooks :func:`offload_model` registered on ``model``; returns how many."""
    handles = _MODEL_HOOKS.pop(model, [])
    for h in handles:
        h.remove()
    return len(handles)


def _resolve(model: nn.Module, m: nn.Module | str, arg: str) -> nn.Module:
    if isinstance(m, nn.Module):
        return m
    try:
        return model.get_submodule(m)
    except AttributeError:
        raise ValueError(f"offload_model({arg}={m!r}): the model has no such submodule") from None


def _enter_hook(guard: NoOffload) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        guard.__enter__()

    return hook


def _exit_hook(guard: NoOffload) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        guard.__exit__(None, None, None)

    return hook
