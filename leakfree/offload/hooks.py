"""The context managers and the copies they make.

:class:`OffloadActivations`'s pack hook returns a handle (:mod:`leakfree.offload.handles`)
that the graph owns; it makes the copies: out in forward, back in backward, on a side
stream where there is an accelerator. :class:`NoOffload` keeps saved tensors where they
are.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, TypeGuard

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from leakfree._device import accelerator, device_index, device_module
from leakfree.offload.handles import (
    _HostCopy,
    _Kept,
    _Offloaded,
    _Session,
    _span,
)
from leakfree.offload.pool import HostBlockPool
from leakfree.offload.streams import _prefetch_plan, _prune_prefetching, _retire

__all__ = ["NoOffload", "OffloadActivations"]


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_min_offload_size(where: str, value: object) -> None:
    """The one check of ``min_offload_size``, at construction and on assignment."""
    if not _is_count(value) or value < 0:
        raise ValueError(f"{where}{value!r}): must be an int >= 0 (bytes)")


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
            device tensors are kept alive until then), as TRL's. At least 1.
        prefetch_depth: how many host-to-device copies backward may have issued ahead of
            their use (with ``use_streams``). 0 turns prefetch off.
        device: the device to offload from; by default the current accelerator. Tensors on
            other device types stay put.
        force_host_copy: on a machine without an accelerator, offload CPU tensors to
            separate host buffers, so the whole path (handles, pool, dedup, lifetimes) runs
            and is tested on CPU; restored tensors view those buffers (nothing is copied
            back on CPU). Without it, on such a machine, nothing is offloaded and the
            context is a cheap no-op.
        pin_memory_budget: bytes of pinned host memory the pool may hold (in use plus
            cached, counted as PyTorch's pinned allocator rounds them: powers of two);
            beyond it copies use pageable memory. Default (None): one budget for the
            whole process, a quarter of RAM, shared by every manager that does not set
            its own (``leakfree.offload.pool.PROCESS_BUDGET``).

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
        prefetch_depth: int = 5,
    ) -> None:
        if not _is_count(max_fwd_stash_size) or max_fwd_stash_size < 1:
            raise ValueError(
                f"OffloadActivations(max_fwd_stash_size={max_fwd_stash_size!r}): must be an "
                "int >= 1 (the number of copies in flight at once)"
            )
        if not _is_count(prefetch_depth) or prefetch_depth < 0:
            raise ValueError(
                f"OffloadActivations(prefetch_depth={prefetch_depth!r}): must be an int >= 0 "
                "(the number of copies backward brings back ahead of use; 0: none)"
            )
        _check_min_offload_size("OffloadActivations(min_offload_size=", min_offload_size)
        target = torch.device(device) if device is not None else accelerator()
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
        self.prefetch_depth = prefetch_depth
        self._device_type = target.type if target is not None else None  # for the pack hook
        self.pool = HostBlockPool(pin_memory_budget, pin=self.use_pin_memory)
        self._device_module: Any = device_module(target) if accelerated and target else None
        #: force_host_copy on the CPU: the "device" is the host itself, so copies out are
        #: plain host copies and restored tensors view the host bytes (no copy back)
        self._on_host = target is not None and target.type == "cpu"
        self._side_streams: dict[torch.device, Any] = {}  # device (with index) -> side stream
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
        _check_min_offload_size("OffloadActivations.min_offload_size = (", value)
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
            copy = session.shared_copy(storage, t._version) if whole else None
            if copy is None:
                start = 0 if whole else first * elem
                nbytes = storage.nbytes() if whole else span_bytes
                copy = _HostCopy(self.pool, nbytes, start, t.device)
                self._copy_out(t, storage, copy)
                if whole:
                    session.remember(copy, storage, t._version)
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

    def _copy_out(self, t: torch.Tensor, storage: torch.UntypedStorage, copy: _HostCopy) -> None:
        src = _bytes_of(storage, t.device, copy.byte_start, copy.nbytes)
        dst = copy.host_bytes()
        if self._on_host:
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
        if self._on_host:
            # the host bytes are already where the tensor lives, so restored tensors view
            # them (no copy back); the block then stays theirs and is never handed out again
            copy.lent = True
            return src, None
        # No wait for compute: the host bytes were written on this same (side) stream.
        side = self._side(copy.device) if self.use_streams else None
        with self._device_module.stream(side):
            dev = copy.to_device(non_blocking=copy.block.pinned)
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
        device = torch.device(device.type, device_index(device))
        side = self._side_streams.get(device)
        if side is None:
            side = self._side_streams[device] = self._device_module.Stream(device=device)
        return side

    # -- backward prefetch (its decisions are plain Python, tested on CPU) -----------------

    def _unpack_prefetch(self, handle: _Offloaded) -> None:
        with self._lock:
            session = handle.session
            live = _prune_prefetching(session.prefetching, handle.index)
            for copy in _prefetch_plan(session, handle, self.prefetch_depth - live):
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
                for device, side in self._side_streams.items():
                    self._device_module.current_stream(device).wait_stream(side)
                while self._in_flight:
                    handle = self._in_flight.popleft()()
                    if handle is not None:
                        handle.in_flight = None
        finally:
            super().__exit__(*exc)


def _bytes_of(
    storage: torch.UntypedStorage, device: torch.device, start: int = 0, nbytes: int | None = None
) -> torch.Tensor:
    """A ``uint8`` view of ``storage``'s bytes ``[start, start + nbytes)`` (all by default)."""
    n = storage.nbytes() - start if nbytes is None else nbytes
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (n,), (1,))


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
