"""A simulated accelerator, ``sim``: CPU memory behind a real PyTorch device type.

leakfree reaches an accelerator only through ``torch.accelerator`` and
``torch.get_device_module(device.type)``. This module registers a PrivateUse1 backend named
``sim`` from Python, so that ``torch.empty(3, device="sim")`` is a plain ``torch.Tensor``
whose bytes are host memory, and ``torch.get_device_module("sim")`` has the surface of
``torch.cuda`` that leakfree uses. That is the only seam: the library runs its real
accelerator code (side streams, events, ``record_stream``, pinned blocks, prefetch) with no
test hook inside it.

What the device does with each operation:

* **Compute** runs at once on host aliases of the device tensors (the CPU kernels, so
  results are bit-identical to CPU). Every aten operation that reaches the device is a
  *launch* on the stream current when it was issued; the :class:`Sanitizer` checks it.
* **Streams and events** are bookkeeping: work is never actually deferred, but every
  ordering PyTorch's stream semantics would give is recorded, so a missing
  ``wait_stream`` / ``wait_event`` is a race the sanitizer reports, not a silent success.
  ``Event.query()`` and ``Stream.query()`` answer True and count as the host observing
  completion (as on CUDA, where a True query orders what the host issues next); with
  ``SimDevice.lazy`` they answer False until the host has waited (a slow device).
* **Pinned memory**: ``pin_memory=True`` host tensors are marked as pinned
  (``is_pinned()`` is True); non-blocking copies between them and the device do not block
  the host, and are launches on the current stream that the sanitizer tracks on both ends.
* **Host waits** are counted in :attr:`SimDevice.syncs` (the sync auditor): device-to-host
  copies into pageable memory or with ``non_blocking=False``, host-to-device copies from
  pageable memory or with ``non_blocking=False``, ``_local_scalar_dense`` (``.item()``),
  operations whose output shape depends on the data, and explicit ``synchronize``.
* **Allocation**: every device storage is an allocation on the current stream, served by
  a model of CUDA's caching allocator (``allocator.py``: rounding, per-stream pools,
  splitting, ``record_stream`` deferring a block's reuse until the recorded streams have
  passed the point of the free, reserved memory, a capacity and a per-process cap that
  raise ``torch.OutOfMemoryError``); the module reports its statistics as ``torch.cuda``
  does. A block freed after ``record_stream`` returns to its pool once those streams'
  work has completed: at once, or (``SimDevice.lazy``) once the host waited for them, or
  (with the timing model attached) when the timeline says so by the host's clock.
  Freeing a storage while another stream may still use it (no ``record_stream`` for that
  stream, no event ordering its last access before the allocation stream) is reported, as
  is any race.

The current stream is process-wide rather than per thread: backward runs on the device's
autograd thread, and where CUDA would give each node the stream of its forward, the
simulation gives it the stream current where backward was called.

Registration is process-wide and permanent (PyTorch has no way to unregister a backend),
and must happen before the process's first backward (:func:`register`; the test suite's
``conftest`` does it at import), so the device is registered once and *switched* on and
off: while off, ``torch.accelerator.is_available()`` is False and the CPU-only code paths
run as on a machine without an accelerator. :func:`enabled` is the switch (the ``sim``
fixture uses it). It relies on private PyTorch APIs (``torch._C._acc``, the DLPack struct
layout): it is used only on the torch versions in :data:`SUPPORTED`.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from leakfree.diagnostics.syncs import DATA_DEPENDENT_OPS

from . import allocator as _allocator

aten = torch.ops.aten
NAME = "sim"
#: One device: the autograd engine of this torch runs backward for a second Python-backend
#: device on no queue at all (an internal assert), so ``sim:1`` cannot be simulated yet.
DEVICES = 1
#: torch versions whose private backend API this module was written against.
SUPPORTED = ("2.13",)
_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_DL_CPU, _DL_EXT = 1, 12  # DLPack device types: kDLCPU, kDLExtDev (PrivateUse1)


def supported() -> bool:
    return torch.__version__.split("+")[0].rsplit(".", 1)[0] in SUPPORTED and not (
        torch.accelerator.is_available() and not _STATE.registered
    )


# --- device memory: host memory re-tagged through DLPack --------------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLHead(ctypes.Structure):  # the first fields of DLTensor
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _retag(t: torch.Tensor, device_type: int, index: int = 0) -> torch.Tensor:
    capsule = torch.utils.dlpack.to_dlpack(t)
    head = _DLHead.from_address(_capsule_pointer(capsule, b"dltensor"))
    head.device.device_type = device_type
    head.device.device_id = index
    return torch._C._from_dlpack(capsule)


def host_alias(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor over the same memory as device tensor ``t`` (same view, lazy bits
    resolved the way the device tensor would resolve them)."""
    conj, neg = t.is_conj(), t.is_neg()
    if not (conj or neg):
        return _retag(t, _DL_CPU)
    raw = aten.alias.default.redispatch(_CPU, t)  # DLPack refuses lazy bits: export raw
    torch._C._set_conj(raw, False)
    torch._C._set_neg(raw, False)
    out = _retag(raw, _DL_CPU)
    if neg:
        out = out._neg_view()
    return out.conj() if conj else out


def _is_sim(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == NAME


# --- streams and events -----------------------------------------------------------------


class Stream(torch.Stream):
    """A stream of the simulated device (a real ``torch.Stream``, as ``record_stream``
    requires), with a process-unique id; the default streams are ``_default_id(index)``."""

    _ids = itertools.count(1)

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
        stream_id = kwargs.pop("stream_id", None)
        if stream_id is None:
            stream_id = next(cls._ids)
        index = kwargs.pop("device_index", None)
        if index is None:
            index = _STATE.device if device is None else _device_index(device)
        self = super().__new__(
            cls,
            stream_id=stream_id,
            device_index=index,
            device_type=int(torch._C._autograd.DeviceType.PrivateUse1),
        )
        _STATE.streams[stream_id] = self
        _STATE.trace("_handle_stream_creation", stream_id)
        return self

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        pass

    def wait_event(self, event: Event) -> None:
        _STATE.log.append(("wait_event", self.stream_id, event.id))
        if event.recorded:
            _STATE.trace("_handle_event_wait", event.id, self.stream_id)

    def wait_stream(self, stream: torch.Stream) -> None:
        # CUDA records an event on ``stream`` and waits for it: so do we.
        self.wait_event(Stream.record_event(stream))  # type: ignore[arg-type]

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event

    def query(self) -> bool:
        _not_capturing("Stream.query")
        if _STATE.timer is not None:  # the timing model says, and the host does not wait
            return bool(_STATE.timer.timeline.stream_done(self.stream_id))
        if _STATE.lazy:
            return False
        _STATE.trace("_handle_stream_synchronization", self.stream_id)
        return True

    def synchronize(self) -> None:
        _not_capturing("Stream.synchronize")
        _STATE.count_sync("Stream.synchronize")
        _STATE.synced(self.stream_id)
        _STATE.trace("_handle_stream_synchronization", self.stream_id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, torch.Stream) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return hash(self.stream_id)


class Event:
    """An event of the simulated device: ``record`` / ``wait`` / ``query`` / ``synchronize``."""

    _ids = itertools.count(1)

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.id = next(Event._ids)
        self.recorded = False
        self.done_after: tuple[int, int] | None = None  # (stream, its sync generation)
        _STATE.trace("_handle_event_creation", self.id)

    def record(self, stream: torch.Stream | None = None) -> None:
        stream = stream if stream is not None else current_stream()
        self.recorded = True
        self.done_after = (stream.stream_id, _STATE.generation(stream.stream_id))
        _STATE.log.append(("record", stream.stream_id, self.id))
        _STATE.trace("_handle_event_record", self.id, stream.stream_id)

    def wait(self, stream: torch.Stream | None = None) -> None:
        stream = stream if stream is not None else current_stream()
        Stream.wait_event(stream, self)  # type: ignore[arg-type]

    def query(self) -> bool:
        _not_capturing("Event.query")
        if self.done_after is None:
            return True
        stream_id, generation = self.done_after
        if _STATE.timer is not None:  # the timing model says, and the host does not wait
            return bool(_STATE.timer.timeline.done(self.id))
        if _STATE.lazy and _STATE.generation(stream_id) <= generation:
            return False  # a slow device: not complete until the host waited for it
        _STATE.trace("_handle_event_synchronization", self.id)
        return True

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds from this event to ``end``, as the timing model has them (0.0
        without one: the simulated device itself takes no time)."""
        timer = _STATE.timer
        if timer is None:
            return 0.0
        timeline = timer.timeline
        if not (timeline.done(self.id) and timeline.done(end.id)):
            # as CUDA: both events must have completed (the host waits for them first)
            raise RuntimeError("elapsed_time: an event has not completed yet")
        return (timeline.event_time(end.id) - timeline.event_time(self.id)) * 1e3

    def synchronize(self) -> None:
        _not_capturing("Event.synchronize")
        _STATE.count_sync("Event.synchronize")
        if self.done_after is not None:
            _STATE.synced(self.done_after[0])
            _STATE.trace("_handle_event_synchronization", self.id)

    def __del__(self) -> None:
        state = _STATE  # None at interpreter shutdown
        if state is not None and state.sanitizer is not None:
            state.sanitizer.event("_handle_event_deletion", self.id)


def _device_index(device: Any) -> int:
    if device is None:
        return _STATE.device
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return _STATE.device if index is None else index


def _default_id(index: int) -> int:
    return 0 if index == 0 else (1 << 40) + index  # 0: the sanitizer's default stream


def current_stream(device: Any = None) -> Stream:
    return _STATE.current[_device_index(device)]


def default_stream(device: Any = None) -> Stream:
    return _STATE.streams[_default_id(_device_index(device))]


def set_stream(stream: Stream) -> None:
    _STATE.current[stream.device_index] = stream


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """``with stream(s):`` makes ``s`` current (process-wide, see the module docstring)."""
    if s is None:
        yield
        return
    index = s.device_index
    previous = _STATE.current[index]
    _STATE.current[index] = s
    try:
        yield
    finally:
        _STATE.current[index] = previous


class _Module:
    """What ``torch.get_device_module("sim")`` returns."""

    Stream = Stream
    Event = Event
    stream = staticmethod(stream)
    current_stream = staticmethod(current_stream)
    default_stream = staticmethod(default_stream)
    set_stream = staticmethod(set_stream)

    def is_available(self) -> bool:
        return _STATE.on

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return DEVICES

    def current_device(self) -> int:
        return _STATE.device

    def set_device(self, device: Any) -> None:
        _STATE.device = device if isinstance(device, int) else torch.device(device).index

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass

    # Random operations run on the host aliases and draw from the CPU generator, whose
    # state checkpointing saves and restores already: the device has none of its own.
    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        pass

    def get_amp_supported_dtype(self) -> list[torch.dtype]:  # autocast (checkpointing)
        return [torch.bfloat16, torch.float16]

    def device(self, device: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def is_current_stream_capturing(self) -> bool:
        return _STATE.capturing

    def synchronize(self, device: Any = None) -> None:
        _not_capturing("synchronize")
        _STATE.count_sync("synchronize")
        for stream_id in list(_STATE.streams):
            _STATE.synced(stream_id)
        _STATE.trace("_handle_device_synchronization")

    # The caching allocator's statistics, as torch.cuda reports them (allocator.py).
    def memory_allocated(self, device: Any = None) -> int:
        return _allocator_of(device).allocated

    def max_memory_allocated(self, device: Any = None) -> int:
        return _allocator_of(device).max_allocated

    def memory_reserved(self, device: Any = None) -> int:
        return _allocator_of(device).reserved

    def max_memory_reserved(self, device: Any = None) -> int:
        return _allocator_of(device).max_reserved

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return _allocator_of(device).memory_stats()

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        with _STATE.lock:
            _allocator_of(device).reset_peaks()

    def reset_accumulated_memory_stats(self, device: Any = None) -> None:
        with _STATE.lock:
            _allocator_of(device).reset_accumulated()

    def reset_max_memory_allocated(self, device: Any = None) -> None:
        self.reset_peak_memory_stats(device)

    def empty_cache(self) -> None:
        with _STATE.lock:
            for index in range(DEVICES):
                _allocator_of(index).empty_cache()
                _STATE.observe(index)

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        with _STATE.lock:
            _allocator_of(device).set_memory_fraction(fraction)

    def get_per_process_memory_fraction(self, device: Any = None) -> float:
        allocator = _allocator_of(device)
        limit = allocator.capacity if allocator.limit is None else allocator.limit
        return limit / allocator.capacity

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        """(free, total) bytes of the device: its capacity less what is reserved (the
        simulated process is the device's only user)."""
        allocator = _allocator_of(device)
        return allocator.capacity - allocator.reserved, allocator.capacity

    def get_device_properties(self, device: Any = None) -> DeviceProperties:
        index = _device_index(device)
        return DeviceProperties(f"{NAME}:{index}", _allocator_of(index).capacity)

    def get_device_name(self, device: Any = None) -> str:
        return self.get_device_properties(device).name


class DeviceProperties:
    """What ``get_device_properties`` answers: a name and ``total_memory``."""

    def __init__(self, name: str, total_memory: int) -> None:
        self.name = name
        self.total_memory = total_memory

    def __repr__(self) -> str:
        return f"DeviceProperties(name={self.name!r}, total_memory={self.total_memory})"


class _AllocatorEvents:
    """The caching allocator's own events (invisible to the program and the sanitizer,
    as the CUDA allocator's are): complete when the stream's work issued before them has
    ended, by the timing model's clock where one is attached, else as the device's
    events complete (at once; with ``lazy``, once the host waited for the stream)."""

    def record(self, stream: int) -> tuple[int, int, Any, float | None]:
        timer = _STATE.timer
        at = timer.timeline.mark(stream) if timer is not None else None
        return stream, _STATE.generation(stream), timer, at

    def query(self, event: tuple[int, int, Any, float | None]) -> bool:
        stream, generation, timer, at = event
        if timer is not None and timer is _STATE.timer:
            return bool(at <= timer.timeline.host)
        return not (_STATE.lazy and _STATE.generation(stream) <= generation)

    def synchronize(self, event: tuple[int, int, Any, float | None]) -> None:
        if self.query(event):
            return
        stream, _, timer, at = event
        _STATE.count_sync("allocator")  # cudaEventSynchronize: the host waits
        _STATE.synced(stream)
        if timer is not None and timer is _STATE.timer:
            timer.timeline.host = max(timer.timeline.host, at)


def _allocator_of(device: Any = None) -> _allocator.CachingAllocator:
    return _STATE.allocators[_device_index(device)]


# --- state, the sync auditor and the sanitizer's feed -------------------------------------


class _State:
    def __init__(self) -> None:
        self.registered = False
        self.on = False
        self.lock = threading.RLock()
        self.streams: dict[int, Stream] = {}
        self.log: list[tuple[Any, ...]] = []
        self.syncs: Counter[str] = Counter()
        #: copies between the host and the device: ``to_host`` / ``to_device`` (how many)
        #: and ``to_host_bytes`` / ``to_device_bytes``
        self.copies: Counter[str] = Counter()
        self.sanitizer: Any = None  # a Sanitizer while one is attached
        self.timer: Any = None  # a timing.Timer while one is attached
        #: one caching allocator per device (new each time the device is switched on)
        self.allocators = self.new_allocators()
        #: device storage pointer -> its allocator block (for ``record_stream``)
        self.blocks: dict[int, _allocator.Block] = {}
        self.pinned: weakref.WeakValueDictionary[int, torch.UntypedStorage] = (
            weakref.WeakValueDictionary()
        )
        self.device = 0  # the current device index
        self.current: dict[int, Stream] = {}  # device index -> its current stream
        #: a slow device: events and streams report completion only once the host has
        #: waited for them (``synchronize``, or a blocking copy), never on their own
        self.lazy = False
        #: shapes only: kernels make uninitialized results of the right shape (on the meta
        #: device) and copies move nothing, so a full-size step runs in seconds for the
        #: timing model; values are garbage, ``.item()`` answers 0
        self.dry = False
        #: a CUDA graph is being captured on the current stream: what capture forbids (an
        #: event's or stream's query or synchronize, a pinned host allocation) raises
        self.capturing = False
        self._generations: Counter[int] = Counter()  # stream -> host waits for it

    @staticmethod
    def new_allocators() -> list[_allocator.CachingAllocator]:
        return [
            _allocator.CachingAllocator(_AllocatorEvents(), name=f"{NAME}:{i}")
            for i in range(DEVICES)
        ]

    def observe(self, index: int) -> None:
        """The timing model, if attached, sees the allocator's counts after a change."""
        if self.timer is not None:
            allocator = self.allocators[index]
            self.timer.timeline.memory(allocator.allocated, allocator.reserved)

    def reset_streams(self) -> None:
        self.current = {i: self.streams[_default_id(i)] for i in range(DEVICES)}

    def generation(self, stream_id: int) -> int:
        return self._generations[stream_id]

    def synced(self, stream_id: int) -> None:
        """The host waited for everything issued to ``stream_id`` so far."""
        self._generations[stream_id] += 1

    def trace(self, handler: str, *args: Any) -> None:
        if self.sanitizer is not None:
            self.sanitizer.event(handler, *args)
        if self.timer is not None:
            self.timer.event(handler, *args)

    def count_sync(self, kind: str) -> None:
        if self.on:
            self.syncs[kind] += 1


_STATE = _State()


def _allocate(host: torch.Tensor, index: int | None) -> torch.Tensor:
    """A device tensor on ``sim:index`` (default: the current device) over ``host``'s
    (fresh) memory, allocated on the current stream (``torch.OutOfMemoryError`` where the
    caching allocator cannot serve it)."""
    nbytes = host.untyped_storage().nbytes()
    index = _STATE.device if index is None else index
    stream = _STATE.current[index].stream_id
    allocator = _STATE.allocators[index]
    block = None
    if nbytes:  # as CUDA: an empty storage takes no block
        with _STATE.lock:
            block = allocator.malloc(nbytes, stream)
            _STATE.observe(index)
    out = _retag(host, _DL_EXT, index)
    storage = out.untyped_storage()
    ptr = storage.data_ptr()
    if block is not None:
        _STATE.blocks[ptr] = block
    _STATE.trace("allocate", ptr, stream)
    weakref.finalize(storage, _free, ptr, index, allocator, block)
    return out


def _free(
    ptr: int, index: int, allocator: _allocator.CachingAllocator, block: _allocator.Block | None
) -> None:
    if block is not None:
        with _STATE.lock:
            if _STATE.blocks.get(ptr) is block:
                del _STATE.blocks[ptr]
            allocator.free(block)
            if allocator is _STATE.allocators[index]:
                _STATE.observe(index)
    _STATE.trace("free", ptr)


def _launch(
    schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, index: int
) -> None:
    stream = _STATE.current[index].stream_id
    if _STATE.sanitizer is not None:
        _STATE.sanitizer.launch(schema, args, kwargs, out, stream)
    if _STATE.timer is not None:
        _STATE.timer.launch(schema, args, kwargs, out, stream)


def _host_waits(index: int) -> None:
    """The host waited for everything issued so far to ``sim:index``'s current stream."""
    stream_id = _STATE.current[index].stream_id
    _STATE.synced(stream_id)
    _STATE.trace("_handle_stream_synchronization", stream_id)


# --- kernels ------------------------------------------------------------------------------


def _empty(
    size: Any,
    *,
    dtype: Any = None,
    layout: Any = None,
    device: Any = None,
    pin_memory: Any = None,
    memory_format: Any = None,
) -> torch.Tensor:
    fmt = memory_format or torch.contiguous_format
    return _allocate(torch.empty(size, dtype=dtype, memory_format=fmt), _index(device))


def _empty_strided(
    size: Any,
    stride: Any,
    *,
    dtype: Any = None,
    layout: Any = None,
    device: Any = None,
    pin_memory: Any = None,
) -> torch.Tensor:
    return _allocate(torch.empty_strided(size, stride, dtype=dtype), _index(device))


def _index(device: Any) -> int | None:
    return None if device is None else torch.device(device).index


def _pinned(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.untyped_storage().data_ptr() in _STATE.pinned


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    to_host, from_host = dst.device.type == "cpu", src.device.type == "cpu"
    if not _STATE.dry:
        (host_alias(dst) if _is_sim(dst) else dst).copy_(host_alias(src) if _is_sim(src) else src)
    index = (src if to_host else dst).device.index
    _launch(aten.copy_.default._schema, (dst, src), {}, dst, index)
    if to_host != from_host:  # one end on the host: a transfer
        way = "to_host" if to_host else "to_device"
        _STATE.copies[way] += 1
        _STATE.copies[f"{way}_bytes"] += dst.nbytes
    host = dst if to_host else src if from_host else None
    if host is not None and not (non_blocking and _pinned(host)):
        _STATE.count_sync("device_to_host" if to_host else "host_to_device")
        _host_waits(index)  # everything the host issues later is ordered after the copy
    return dst


def _resize_(self: torch.Tensor, size: Any, memory_format: Any = None) -> torch.Tensor:
    storage = self.untyped_storage()
    need = (self.storage_offset() + math.prod(size)) * self.element_size()
    if need <= storage.nbytes():
        return aten.resize_.default.redispatch(_CPU, self, size, memory_format=memory_format)
    new = _allocate(torch.zeros(need, dtype=torch.uint8), self.device.index)
    if storage.nbytes():
        old = aten.set_.source_Storage.redispatch(
            _CPU, torch.empty(0, dtype=torch.uint8, device=self.device), storage
        )
        host_alias(new)[: storage.nbytes()].copy_(host_alias(old))
    stride = torch.empty(size, device="meta").stride()
    aten.set_.source_Storage_storage_offset.redispatch(
        _CPU, self, new.untyped_storage(), self.storage_offset(), size, stride
    )
    return self


def _record_stream(self: torch.Tensor, s: torch.Stream) -> None:
    ptr = self.untyped_storage().data_ptr()
    _STATE.log.append(("record_stream", ptr, s.stream_id))
    _STATE.trace("record_stream", ptr, s.stream_id)
    block = _STATE.blocks.get(ptr)
    if block is not None:
        with _STATE.lock:
            _STATE.allocators[self.device.index].record_stream(block, s.stream_id)


def _local_scalar_dense(self: torch.Tensor) -> Any:
    _launch(aten._local_scalar_dense.default._schema, (self,), {}, None, self.device.index)
    _STATE.count_sync("_local_scalar_dense")
    _host_waits(self.device.index)
    if _STATE.dry:
        return torch.zeros((), dtype=self.dtype).item()
    return host_alias(self).item()


#: Operations whose output shape (or result) the host must read back from the device: the
#: list the host-sync counter uses (one list, so the two cannot disagree).
_DATA_DEPENDENT = DATA_DEPENDENT_OPS


def _data_dependent(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    name = op.overloadpacket.__name__
    if name in _DATA_DEPENDENT:
        return True
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None and isinstance(args[0], torch.Tensor)
    if name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1:
        return any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in args[1] or ()
        )
    return False


def _sdp_choice(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> int:
    """The attention backend the CPU would choose for the same inputs (``requires_grad``
    included: it decides what the fused kernels accept)."""

    def host(x: torch.Tensor) -> torch.Tensor:
        h = host_alias(x).detach()
        return h.requires_grad_(x.requires_grad) if x.is_floating_point() else h

    mask = kwargs.get("attn_mask")
    if isinstance(mask, torch.Tensor) and _is_sim(mask):
        kwargs = {**kwargs, "attn_mask": host_alias(mask)}
    return int(torch.ops.aten._fused_sdp_choice(host(query), host(key), host(value), **kwargs))


_FLASH = 1  #: ``torch.nn.attention.SDPBackend.FLASH_ATTENTION``


def _scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Attention as the CPU runs it (its flash kernel where it would choose it). The
    composite kernel asks a dispatch stub a Python backend cannot fill, and falls back to
    the math path, which saves the batch x heads x length x length probabilities that no
    accelerator's fused kernel keeps: what an offloader moves would be wrong."""
    named = {"attn_mask": attn_mask, "dropout_p": dropout_p, "is_causal": is_causal,
             "scale": scale, "enable_gqa": enable_gqa}  # fmt: skip
    if _sdp_choice(query, key, value, **named) == _FLASH and not enable_gqa:
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )
        return out
    out, _ = torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale,
        enable_gqa=enable_gqa,
    )  # fmt: skip
    return out


def _dry(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``op``'s results, uninitialized, shaped by running it on the meta device (the
    simulated device's dry mode: no compute, no data)."""

    def meta(x: Any) -> Any:
        return x.to("meta") if isinstance(x, torch.Tensor) else x

    def empty(r: Any) -> Any:
        if isinstance(r, torch.Tensor) and r.device.type == "meta":
            return torch.empty_strided(r.shape, r.stride(), dtype=r.dtype)
        return r

    margs, mkwargs = pytree.tree_map(meta, (args, kwargs))
    result = op(*margs, **mkwargs)
    for name, value in mkwargs.items():  # out= results were sized on meta: size them here
        if isinstance(value, torch.Tensor) and isinstance(kwargs.get(name), torch.Tensor):
            kwargs[name].resize_(value.shape)
    return pytree.tree_map(empty, result)


def _fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``op`` on host aliases of its device arguments (views stay device views)."""
    schema = op._schema
    returns = schema.returns
    views = returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
    if op.overloadpacket is aten.set_ or views:
        return op.redispatch(_CPU, *args, **kwargs)  # metadata only: the CPU kernel works
    if _data_dependent(op, args, kwargs):
        _STATE.count_sync(f"data_dependent:{op.overloadpacket.__name__}")
    host = pytree.tree_map(lambda x: host_alias(x) if _is_sim(x) else x, (args, kwargs))
    host_args, host_kwargs = host
    outs = [
        a.name
        for a in schema.arguments
        if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
    ]
    for name in outs:  # out=: let the host kernel size its result, then copy it over
        if _is_sim(kwargs.get(name)):
            host_kwargs[name] = torch.empty(0, dtype=kwargs[name].dtype)
    result = _dry(op, host_args, host_kwargs) if _STATE.dry else op(*host_args, **host_kwargs)
    for name in outs:
        out = kwargs.get(name)
        if _is_sim(out):
            if out.shape != host_kwargs[name].shape:
                _resize_(out, host_kwargs[name].shape)
            if not _STATE.dry:
                host_alias(out).copy_(host_kwargs[name])
    given = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args) :]]
    index = next(x.device.index for x in pytree.tree_leaves((args, kwargs)) if _is_sim(x))

    def back(r: Any, i: int) -> Any:
        info = returns[i].alias_info if i < len(returns) else None
        if info is not None and info.is_write:  # returns a mutated argument: give it back
            for a, v in zip(schema.arguments, given):
                if a.alias_info is not None and a.alias_info.before_set == info.before_set:
                    return v
        if isinstance(r, torch.Tensor) and r.device.type == "cpu":
            return _allocate(r, index)
        if isinstance(r, (list, tuple)) and r and all(isinstance(x, torch.Tensor) for x in r):
            return type(r)(_allocate(x, index) for x in r)
        return r

    out = (
        tuple(back(r, i) for i, r in enumerate(result))
        if isinstance(result, tuple)
        else (back(result, 0))
    )
    _launch(schema, args, kwargs, out, index)
    return out


# --- pinned host memory -------------------------------------------------------------------


def _dispatch_keyset(device: Any, layout: Any) -> torch._C.DispatchKeySet:
    dev = torch.device(device) if device is not None else torch.device("cpu")
    name = "PrivateUse1" if dev.type == NAME else torch._C._dispatch_key_for_device(dev.type)
    if layout == torch.sparse_coo:
        name = "Sparse" + name
    elif layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        name = "SparseCsr" + name
    elif layout == torch._mkldnn:  # type: ignore[attr-defined]
        name = "MkldnnCPU"
    return torch._C.DispatchKeySet(torch._C._parse_dispatch_key(name))


def _pinning(op: Any) -> Any:
    """A BackendSelect kernel for factory ``op``: what torch does for ``pin_memory=True``
    asks the accelerator's pinned allocator, which a Python backend cannot provide, so
    allocate ordinary memory and mark its storage pinned instead."""

    def kernel(*args: Any, pin_memory: Any = None, **kwargs: Any) -> torch.Tensor:
        keys = _dispatch_keyset(kwargs.get("device"), kwargs.get("layout"))
        t: torch.Tensor = op.redispatch(keys, *args, pin_memory=False, **kwargs)
        if pin_memory:
            _mark_pinned(t)
        return t

    return kernel


def _not_capturing(what: str) -> None:
    """As CUDA: ``what`` is not permitted while a graph is captured."""
    if _STATE.capturing:
        raise RuntimeError(f"{what}: operation not permitted when stream is capturing")


def _mark_pinned(t: torch.Tensor) -> None:
    _not_capturing("pinned host allocation")
    storage = t.untyped_storage()
    _STATE.pinned[storage.data_ptr()] = storage
    _STATE.trace("allocate_pinned", storage.data_ptr())


def _is_pinned(self: torch.Tensor, device: Any = None) -> bool:
    return _pinned(self)


def _pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
    empty = _pinning(aten.empty.memory_format)
    return empty(self.shape, dtype=self.dtype, pin_memory=True).copy_(self)


def _storage_clone(self: torch.UntypedStorage) -> torch.UntypedStorage:
    # UntypedStorage(n, device="sim") reaches a null allocator (a crash): clone (deepcopy
    # uses it) allocates through the dispatcher instead.
    if self.device.type != NAME:
        return _ORIGINAL_CLONE(self)
    out = torch.empty(self.nbytes(), dtype=torch.uint8, device=self.device)
    out.copy_(torch.empty(0, dtype=torch.uint8, device=self.device).set_(self))
    return out.untyped_storage()


_ORIGINAL_CLONE = torch.UntypedStorage.clone


# --- registration and the switch ----------------------------------------------------------

_LIBRARIES: list[Any] = []  # permanent: kernels for the sim key only


def _register() -> None:
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(NAME, backend_module=_Module())
    for index in range(DEVICES):
        Stream(stream_id=_default_id(index), device_index=index)
    _STATE.reset_streams()
    lib = torch.library.Library("aten", "IMPL")
    special = {
        "empty.memory_format": _empty,
        "empty_strided": _empty_strided,
        "_copy_from": _copy_from,
        "resize_": _resize_,
        "_local_scalar_dense": _local_scalar_dense,
        "record_stream": _record_stream,
    }
    for name, fn in special.items():
        lib.impl(name, fn, "PrivateUse1")
    lib.impl("scaled_dot_product_attention", _scaled_dot_product_attention, "AutogradPrivateUse1")
    # A composite kernel would otherwise win over the fallback, and may decompose
    # differently from the CPU kernel (native_layer_norm does): run every aten op that has
    # a CPU kernel through the CPU kernel, so results are bit-identical to CPU.
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::") or qualified[6:] in special:
            continue
        if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "PrivateUse1"):
            continue
        if not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU"):
            continue
        if not any(
            torch._C._dispatch_has_kernel_for_dispatch_key(qualified, k)
            for k in ("CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")
        ):
            continue
        base, _, overload = qualified[6:].partition(".")
        op = getattr(getattr(aten, base, None), overload or "default", None)
        if op is not None:
            lib.impl(op, _routed(op), "PrivateUse1")
    # Lazy conj/neg bits: their fallbacks would materialise _copy_from's inputs by a clone
    # that copies through _copy_from again, endlessly; resolve them on the host alias.
    for key in ("Conjugate", "Negative"):
        lib.impl("_copy_from", torch.library.fallthrough_kernel, key)
    boxed = torch.library.Library("_", "IMPL")
    boxed.fallback(_fallback, "PrivateUse1")
    _LIBRARIES.extend([lib, boxed])
    _STATE.registered = True


def register() -> None:
    """Register the device (off), once per process, before the first backward anywhere.

    The autograd engine sizes its per-device queues at its first backward, from the
    devices registered then: a device registered later has no queue.
    """
    if not _STATE.registered and supported():
        _register()


def _routed(op: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return _fallback(op, *args, **kwargs)

    return kernel


class _Switch:
    """What is installed only while the device is on: pinned memory on the CPU side,
    ``torch.accelerator.synchronize``, ``UntypedStorage.clone``."""

    def __init__(self) -> None:
        self.lib: Any = None
        self.saved: list[tuple[Any, str, Any]] = []

    def on(self) -> None:
        self.lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "overriding a previously registered kernel"
            warnings.simplefilter("ignore", UserWarning)
            for name, op in (
                ("empty.memory_format", aten.empty.memory_format),
                ("empty_strided", aten.empty_strided.default),
            ):
                self.lib.impl(name, _pinning(op), "BackendSelect")
            self.lib.impl("is_pinned", _is_pinned, "CPU")
            self.lib.impl("_pin_memory", _pin_memory, "CPU")
        module = torch.get_device_module(NAME)
        for owner, attr, value in (
            # the class's function: a counter wrapping module.synchronize must not see it
            (torch.accelerator, "synchronize", lambda device=None: _Module.synchronize(module)),
            (torch.UntypedStorage, "clone", _storage_clone),
            *_accelerator_memory(module),
        ):
            self.saved.append((owner, attr, owner.__dict__.get(attr, _ABSENT)))
            setattr(owner, attr, value)

    def off(self) -> None:
        for owner, attr, value in reversed(self.saved):
            if value is _ABSENT:
                delattr(owner, attr)
            else:
                setattr(owner, attr, value)
        self.saved.clear()
        if self.lib is not None:
            self.lib._destroy()
            self.lib = None


def _accelerator_memory(module: _Module) -> list[tuple[Any, str, Any]]:
    """``torch.accelerator``'s memory functions ask the backend's C++ allocator, which a
    Python backend has none of (they would answer 0): answer from the simulated one."""
    c = torch._C
    return [
        (c, "_accelerator_isAllocatorInitialized", lambda: True),
        (c, "_accelerator_getDeviceStats", module.memory_stats),
        (c, "_accelerator_getMemoryInfo", module.mem_get_info),
        (c, "_accelerator_emptyCache", module.empty_cache),
        (c, "_accelerator_resetPeakStats", module.reset_peak_memory_stats),
        (c, "_accelerator_resetAccumulatedStats", module.reset_accumulated_memory_stats),
    ]


_SWITCH = _Switch()
_ABSENT = object()


class SimDevice:
    """The switched-on device: its name, streams, counters and memory statistics."""

    type = NAME
    sanitizer: Any = None  #: the attached Sanitizer, set by the fixture

    @property
    def device(self) -> torch.device:
        return torch.device(NAME, 0)

    @property
    def module(self) -> Any:
        return torch.get_device_module(NAME)

    @property
    def syncs(self) -> Counter[str]:
        """Host waits counted since the device was switched on (or :meth:`reset_syncs`)."""
        return _STATE.syncs

    def reset_syncs(self) -> None:
        _STATE.syncs.clear()

    @property
    def copies(self) -> Counter[str]:
        """Transfers since the device was switched on (or :meth:`reset_copies`):
        ``to_host``, ``to_device`` and their ``_bytes``."""
        return _STATE.copies

    def reset_copies(self) -> None:
        _STATE.copies.clear()

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """As ``torch.cuda.graph(g)`` around the block: the current stream captures, and
        what capture forbids raises (the kernels themselves run, as the sim runs them)."""
        _STATE.capturing = True
        try:
            yield
        finally:
            _STATE.capturing = False

    def peak(self) -> int:
        """The most device bytes allocated at once since :meth:`reset_peak`
        (``max_memory_allocated``)."""
        return _STATE.allocators[0].max_allocated

    def held_peak(self) -> int:
        """The most device bytes reserved at once since :meth:`reset_peak`
        (``max_memory_reserved``: what the device held, cached blocks and blocks waiting
        for other streams included)."""
        return _STATE.allocators[0].max_reserved

    def reset_peak(self) -> None:
        """``reset_peak_memory_stats``: both peaks start again from now."""
        with _STATE.lock:
            _STATE.allocators[0].reset_peaks()

    @property
    def log(self) -> list[tuple[Any, ...]]:
        """``("record", stream, event)``, ``("wait_event", stream, event)``,
        ``("record_stream", storage pointer, stream)`` in issue order."""
        return _STATE.log

    @property
    def lazy(self) -> bool:
        """A slow device (default False): ``query()`` is False until the host waited."""
        return _STATE.lazy

    @lazy.setter
    def lazy(self, value: bool) -> None:
        _STATE.lazy = value

    @property
    def dry(self) -> bool:
        """Shapes only (default False): no compute, no data moved (the timing model's
        full-size runs)."""
        return _STATE.dry

    @dry.setter
    def dry(self, value: bool) -> None:
        _STATE.dry = value

    def allocated(self) -> int:
        """Bytes allocated now (``memory_allocated``: rounded block sizes)."""
        return _STATE.allocators[0].allocated

    def reserved(self) -> int:
        """Bytes the device holds now (``memory_reserved``)."""
        return _STATE.allocators[0].reserved

    @property
    def allocator(self) -> _allocator.CachingAllocator:
        """The device's caching allocator (``allocator.py``)."""
        return _STATE.allocators[0]

    @property
    def capacity(self) -> int:
        """The device's memory in bytes (default 80 GiB): ``get_device_properties``'s
        ``total_memory``; an allocation that would reserve more raises
        ``torch.OutOfMemoryError``."""
        return _STATE.allocators[0].capacity

    @capacity.setter
    def capacity(self, nbytes: int) -> None:
        if nbytes < self.reserved():
            raise ValueError(
                f"SimDevice.capacity = {nbytes}: {self.reserved()} bytes are reserved "
                "already; call empty_cache() first or give at least that much"
            )
        _STATE.allocators[0].capacity = nbytes

    @property
    def limit(self) -> int | None:
        """The per-process cap on reserved bytes (``set_per_process_memory_fraction``
        sets it as a fraction of :attr:`capacity`); None: the capacity."""
        return _STATE.allocators[0].limit

    @limit.setter
    def limit(self, nbytes: int | None) -> None:
        if nbytes is not None and nbytes < 0:
            raise ValueError(f"SimDevice.limit = {nbytes}: expected bytes >= 0, or None")
        _STATE.allocators[0].limit = nbytes


@contextlib.contextmanager
def enabled() -> Iterator[SimDevice]:
    """Switch the simulated device on (registering it the first time) for the block."""
    if not supported():
        raise RuntimeError(f"the simulated device needs torch {' or '.join(SUPPORTED)}.x")
    if _STATE.on:
        raise RuntimeError("the simulated device is already on")
    register()
    _SWITCH.on()
    _STATE.on = True
    _STATE.lazy = False
    _STATE.dry = False
    _STATE.syncs.clear()
    _STATE.copies.clear()
    _STATE.log.clear()
    _STATE.reset_streams()
    _STATE.device = 0
    _STATE.allocators = _STATE.new_allocators()  # storages still alive free into the old
    _STATE.blocks.clear()
    try:
        yield SimDevice()
    finally:
        _STATE.on = False
        _STATE.reset_streams()
        _STATE.device = 0
        _SWITCH.off()
