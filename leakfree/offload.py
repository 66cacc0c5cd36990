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
"""

from __future__ import annotations

import math
import os
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.hooks import RemovableHandle

__all__ = [
    "HostBlockPool",
    "NoOffload",
    "OffloadActivations",
    "OffloadWarning",
    "offload_model",
    "remove_offload_hooks",
]


class OffloadWarning(UserWarning):
    """Something about offloading that costs speed or memory (never correctness)."""


# --- host memory ---------------------------------------------------------------------------


def _size_class(nbytes: int) -> int:
    """Pool blocks come in size classes: powers of two up to 1 MiB, then whole MiB."""
    if nbytes <= 4096:
        return 4096
    if nbytes <= 1 << 20:
        return 1 << math.ceil(math.log2(nbytes))
    return ((nbytes + (1 << 20) - 1) >> 20) << 20


def _default_budget() -> int:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover  (non-POSIX)
        total = 16 << 30
    return int(total // 4)


class HostBlock:
    """One host buffer (a 1-D ``uint8`` tensor) from a :class:`HostBlockPool`.

    ``event`` is the last device event that reads or writes it; the pool does not hand the
    block out again before that event has completed.
    """

    __slots__ = ("__weakref__", "data", "event", "pinned", "pooled", "size")

    def __init__(self, size: int, pinned: bool) -> None:
        self.size = size
        self.pinned = pinned
        self.pooled = True
        self.data = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        self.event: Any = None

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())


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
    a new one. New blocks join the pool while ``pooled_bytes`` stays within ``budget``;
    beyond it they are pageable "overflow" blocks, freed again on release (with ``pin``,
    copies to them are synchronous: an :class:`OffloadWarning` is issued once). ``release``
    caches pooled blocks. Thread-safe.
    """

    def __init__(self, budget: int | None = None, *, pin: bool = True) -> None:
        if budget is not None and (not isinstance(budget, int) or budget < 0):
            raise ValueError(f"HostBlockPool(budget={budget!r}): must be an int >= 0 (bytes)")
        self.budget = _default_budget() if budget is None else budget
        self.pin = pin
        self.stats = PoolStats()
        self._free: dict[int, list[HostBlock]] = {}
        self._lock = threading.Lock()
        self._warned = False

    def acquire(self, nbytes: int) -> HostBlock:
        size = _size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                block = next((b for b in free if b.ready()), None)
                if block is None:
                    block = free[0]  # all busy: wait for the oldest copy to finish
                    block.event.synchronize()
                free.remove(block)
                self.stats.cached_bytes -= size
                self.stats.in_use_bytes += size
                self.stats.reuses += 1
                return block
            pooled = self.stats.pooled_bytes + size <= self.budget
            self.stats.in_use_bytes += size
            if pooled:
                self.stats.pooled_bytes += size
                self.stats.allocations += 1
            else:
                self.stats.overflows += 1
                warn = self.pin and not self._warned
                self._warned = self._warned or warn
        if not pooled and warn:
            warnings.warn(
                f"OffloadActivations: the pinned host memory budget ({self.budget} bytes) is "
                "used up; further host copies use pageable memory and are synchronous. "
                "Raise pin_memory_budget, or offload less (min_offload_size, NoOffload).",
                OffloadWarning,
                stacklevel=5,
            )
        block = HostBlock(size, pinned=pooled and self.pin)
        block.pooled = pooled
        return block

    def release(self, block: HostBlock) -> None:
        with self._lock:
            self.stats.in_use_bytes -= block.size
            if block.pooled:
                self._free.setdefault(block.size, []).append(block)
                self.stats.cached_bytes += block.size

    def trim(self) -> int:
        """Free every cached block; returns the bytes freed."""
        with self._lock:
            freed = self.stats.cached_bytes
            self.stats.pooled_bytes -= freed
            self.stats.cached_bytes = 0
            self._free.clear()
        return freed


# --- what the graph owns ---------------------------------------------------------------------


def _span(t: torch.Tensor) -> tuple[int, int]:
    """First and one-past-last element index of ``t`` in its storage (in elements)."""
    offset = int(t.storage_offset())
    if t.numel() == 0:
        return offset, offset
    last = offset + sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride()))
    return offset, last + 1


class _HostCopy:
    """Host bytes of (a span of) one device storage, shared by the handles that use them.

    Returns its pool block when the last handle using it dies.
    """

    __slots__ = (
        "__weakref__",
        "block",
        "byte_start",
        "device",
        "nbytes",
        "pool",
        "prefetched",
        "restored",
        "source",
    )

    def __init__(
        self, pool: HostBlockPool, nbytes: int, byte_start: int, device: torch.device
    ) -> None:
        self.pool = pool
        self.block = pool.acquire(nbytes)
        self.nbytes = nbytes
        self.byte_start = byte_start  # where the copied bytes start in the source storage
        self.device = device
        self.source: Any = None  # weak reference to the source storage (dedup validity)
        self.restored: Any = None  # weak reference to a live restored storage
        self.prefetched: tuple[torch.Tensor, Any] | None = None  # (device bytes, event)

    def host_bytes(self) -> torch.Tensor:
        return self.block.data[: self.nbytes]

    def __del__(self) -> None:
        block = getattr(self, "block", None)
        if block is not None:
            self.pool.release(block)


class _Offloaded:
    """The packed form of one saved tensor: the graph owns it, and it owns everything."""

    __slots__ = (
        "__weakref__",
        "copy",
        "dtype",
        "element_offset",
        "event",
        "in_flight",
        "index",
        "manager",
        "session",
        "shape",
        "stride",
    )

    def __init__(
        self,
        manager: OffloadActivations,
        session: _Session,
        copy: _HostCopy,
        t: torch.Tensor,
        element_offset: int,
    ) -> None:
        self.manager = manager
        self.session = session
        self.index = len(session.tape)  # position in pack order
        self.copy = copy
        self.dtype = t.dtype
        self.shape = t.shape
        self.stride = t.stride()
        self.element_offset = element_offset  # storage offset within the copied bytes
        self.in_flight: torch.Tensor | None = None  # device tensor while its copy runs
        self.event: Any = None

    def unpack(self) -> torch.Tensor:
        if self.in_flight is not None:
            return self.in_flight  # never left the device: its copy has not even retired
        storage = self.manager._restore(self.copy, self.session)
        out = torch.empty(0, dtype=self.dtype, device=self.copy.device)
        out.set_(storage, self.element_offset, self.shape, self.stride)
        return out


# --- the context managers ---------------------------------------------------------------------


class _Session:
    """One ``with`` block's pack order (for prefetch) and storage dedup map.

    Holds handles and host copies weakly: it owns no payload.
    """

    __slots__ = ("__weakref__", "prefetched", "shared", "tape")

    def __init__(self) -> None:
        self.tape: list[weakref.ref[_Offloaded]] = []
        self.shared: weakref.WeakValueDictionary[tuple[int, int], _HostCopy] = (
            weakref.WeakValueDictionary()
        )
        self.prefetched = 0


def _accelerator() -> torch.device | None:
    if not torch.accelerator.is_available():
        return None
    return torch.accelerator.current_accelerator()


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
            other devices stay put.
        force_host_copy: on a machine without an accelerator, offload CPU tensors to
            separate host buffers and back, so the whole path (handles, pool, dedup,
            lifetimes) runs and is tested on CPU. Without it, on such a machine, nothing is
            offloaded and the context is a cheap no-op.
        pin_memory_budget: bytes of pinned host memory the pool may hold (in use plus
            cached); beyond it copies use pageable memory. Default: a quarter of RAM.

    Parameters, buffers (``update_model_params``), tensor subclasses, non-strided layouts
    and tensors with lazy conj/neg bits are never offloaded. Several views of one storage
    are copied once and restored as views of one storage again. The restored tensor has the
    original shape, strides and storage offset, so gradients are bit-identical.

    ``__exit__`` makes the compute stream wait for the side stream and drops every device
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
        self.pool = HostBlockPool(pin_memory_budget, pin=self.use_pin_memory)
        self._device_module: Any = (
            torch.get_device_module(target.type) if accelerated and target is not None else None
        )
        self._side_stream: Any = None  # created on first use, on the target device
        self._param_storages: frozenset[int] = frozenset()
        self._session = _Session()
        self._in_flight: deque[weakref.ref[_Offloaded]] = deque()
        self._lock = threading.Lock()
        self.enabled = target is not None
        super().__init__(self._pack, self._unpack)

    # -- configuration ------------------------------------------------------------------

    def update_model_params(self, model: nn.Module) -> None:
        """Never offload ``model``'s parameters and buffers (matched by storage)."""
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

    def _eligible(self, t: torch.Tensor) -> bool:
        return (
            self.enabled
            and type(t) is torch.Tensor  # not Parameters, not subclasses (DTensor, FP8, ...)
            and not isinstance(t._base, nn.Parameter)  # weight.t() and other parameter views
            and self.device is not None
            and t.device.type == self.device.type
            and t.layout == torch.strided
            and t.numel() * t.element_size() >= max(self.min_offload_size, 1)
            and not t.is_conj()
            and not t.is_neg()
            and t.untyped_storage().data_ptr() not in self._param_storages
        )

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._eligible(t):
            return t  # kept as plain PyTorch would keep it
        storage = t.untyped_storage()
        elem = t.element_size()
        first, end = _span(t)
        span_bytes = (end - first) * elem
        whole = storage.nbytes() <= 2 * span_bytes
        session = self._session
        copy = self._shared_copy(session, storage, t._version) if whole else None
        if copy is None:
            start = 0 if whole else first * elem
            nbytes = storage.nbytes() if whole else span_bytes
            copy = _HostCopy(self.pool, nbytes, start, t.device)
            self._copy_out(t, storage, copy)
            if whole:
                copy.source = weakref.ref(storage)
                session.shared[(storage.data_ptr(), t._version)] = copy
        offset = int(t.storage_offset()) - copy.byte_start // elem
        handle = _Offloaded(self, session, copy, t, offset)
        session.tape.append(weakref.ref(handle))
        if self.use_streams:
            # The device tensor stays alive (owned by the handle) until its copy retires.
            handle.in_flight = t
            handle.event = copy.block.event
            self._push_in_flight(handle)
        return handle

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        out: torch.Tensor = packed.unpack()
        if self.use_streams:
            self._prefetch_before(packed)
        return out

    # -- copies -----------------------------------------------------------------------------

    def _shared_copy(
        self, session: _Session, storage: torch.UntypedStorage, version: int
    ) -> _HostCopy | None:
        """A host copy of this very storage, at this version, made during this forward.

        Keyed by address and version counter (an in-place write makes a new copy), and
        valid only while the storage it was copied from is alive (an address is reused
        only after its storage died): no stale keys, nothing to clean up.
        """
        copy = session.shared.get((storage.data_ptr(), version))
        if copy is not None and copy.source is not None and copy.source() is not None:
            return copy
        return None

    def _copy_out(self, t: torch.Tensor, storage: torch.UntypedStorage, copy: _HostCopy) -> None:
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        src = src[copy.byte_start : copy.byte_start + copy.nbytes]
        dst = copy.host_bytes()
        if self.use_streams:
            compute = self._device_module.current_stream(t.device)
            side = self._side(t.device)
            side.wait_stream(compute)  # the activation is complete before we read it
            with self._device_module.stream(side):
                dst.copy_(src, non_blocking=self.use_pin_memory)
                event = side.record_event()
            # The allocator must not hand this block to anyone before the copy ran, even if
            # every reference to it is dropped early (e.g. the graph dies in forward).
            t.record_stream(side)
        elif self._device_module is not None:
            dst.copy_(src, non_blocking=self.use_pin_memory)
            event = self._device_module.current_stream(t.device).record_event()
        else:
            dst.copy_(src)
            event = None
        copy.block.event = event

    def _restore(self, copy: _HostCopy, session: _Session) -> torch.UntypedStorage:
        """A device storage holding ``copy``'s bytes (shared with a live restored sibling)."""
        if copy.restored is not None:
            alive = copy.restored()
            if alive is not None:
                return alive  # type: ignore[no-any-return]
        if copy.prefetched is not None:
            dev, event = copy.prefetched
            copy.prefetched = None
            session.prefetched = max(0, session.prefetched - 1)
            compute = self._device_module.current_stream(copy.device)
            compute.wait_event(event)
            dev.record_stream(compute)  # allocated on the side stream, used on compute
        else:
            dev = self._copy_in(copy)
        storage = dev.untyped_storage()
        copy.restored = weakref.ref(storage)
        return storage

    def _copy_in(self, copy: _HostCopy, *, prefetch: bool = False) -> torch.Tensor:
        src = copy.host_bytes()
        if self.use_streams:
            compute = self._device_module.current_stream(copy.device)
            side = self._side(copy.device)
            side.wait_stream(compute)  # `dev` was allocated on compute: ordered before use
            with self._device_module.stream(side):
                dev = torch.empty(copy.nbytes, dtype=torch.uint8, device=copy.device)
                dev.copy_(src, non_blocking=self.use_pin_memory)
                event = side.record_event()
            copy.block.event = event  # the host block is read until this completes
            if prefetch:
                copy.prefetched = (dev, event)
            else:
                compute.wait_event(event)
                dev.record_stream(compute)
        else:
            dev = torch.empty(copy.nbytes, dtype=torch.uint8, device=copy.device)
            dev.copy_(src, non_blocking=self.use_pin_memory)
            if self._device_module is not None:
                copy.block.event = self._device_module.current_stream(copy.device).record_event()
        return dev

    def _side(self, device: torch.device) -> Any:
        if self._side_stream is None:
            self._side_stream = self._device_module.Stream(device=device)
        return self._side_stream

    # -- in-flight window and prefetch (their decisions are plain Python, tested on CPU) ----

    def _push_in_flight(self, handle: _Offloaded) -> None:
        for old in _retire(self._in_flight, weakref.ref(handle), self.max_fwd_stash_size):
            self._retire_one(old)

    def _retire_one(self, handle: _Offloaded) -> None:
        # Compute waits for the copy; after that, dropping the device tensor is safe: the
        # allocator reuses its block only for work ordered after this point.
        if handle.event is not None and self._device_module is not None:
            self._device_module.current_stream(handle.copy.device).wait_event(handle.event)
        handle.in_flight = None

    def _prefetch_before(self, handle: _Offloaded) -> None:
        session = handle.session
        budget = self.max_fwd_stash_size - session.prefetched
        for copy in _prefetch_plan(session.tape, handle, budget):
            self._copy_in(copy, prefetch=True)
            session.prefetched += 1

    # -- context ------------------------------------------------------------------------------

    def __enter__(self) -> OffloadActivations:  # type: ignore[override]
        # A fresh tape for prefetch; the previous forward's handles keep their own session.
        self._session = _Session()
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.use_streams and self._side_stream is not None and self.device is not None:
                compute = self._device_module.current_stream(self.device)
                compute.wait_stream(self._side_stream)
            while self._in_flight:
                handle = self._in_flight.popleft()()
                if handle is not None:
                    handle.in_flight = None
        finally:
            super().__exit__(*exc)


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


def _prefetch_plan(
    tape: list[weakref.ref[_Offloaded]], current: _Offloaded, budget: int
) -> list[_HostCopy]:
    """Host copies to bring back ahead of time: those packed just before ``current``.

    Backward runs roughly in reverse pack order, so the tensors saved right before the one
    being unpacked are needed next. Skips what is still on device, already restored or
    prefetched, and handles whose graph is gone. At most ``budget`` copies.
    """
    if budget <= 0:
        return []
    plan: list[_HostCopy] = []
    seen: set[int] = {id(current.copy)}
    for index in range(current.index - 1, -1, -1):
        ref = tape[index]
        handle = ref()
        if handle is None or handle.in_flight is not None or id(handle.copy) in seen:
            continue
        copy = handle.copy
        seen.add(id(copy))
        if copy.prefetched is not None or (copy.restored is not None and copy.restored()):
            continue
        plan.append(copy)
        if len(plan) >= budget:
            break
    return plan


class NoOffload(saved_tensors_hooks):
    """Inside this context, saved tensors are kept as plain PyTorch keeps them.

    Use it around parts of the forward whose activations are needed again right away
    (the output head), or that must not move. Nests with :class:`OffloadActivations` and
    with itself: the innermost context decides.
    """

    def __init__(self) -> None:
        super().__init__(_identity, _identity)


def _identity(t: Any) -> Any:
    return t


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
