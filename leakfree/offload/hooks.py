"""The context managers and the copies they make.

:class:`OffloadActivations`'s pack hook returns a handle (:mod:`leakfree.offload.handles`)
that the graph owns; it makes the copies: out in forward, back in backward, on a side
stream where there is an accelerator. :class:`NoOffload` keeps saved tensors where they
are.
"""

from __future__ import annotations

import functools
import operator
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

import leakfree._args as _args
from leakfree._device import accelerator, device_index, device_module
from leakfree.offload.handles import (
    _Forward,
    _Group,
    _HostCopy,
    _Kept,
    _Offloaded,
    _span,
)
from leakfree.offload.measure import StepMeasure, bandwidth
from leakfree.offload.plan import OffloadPlan, Planner
from leakfree.offload.pool import HostBlock, HostBlockPool
from leakfree.offload.streams import (
    Flight,
    Order,
    _Copies,
    _follow,
    _Pass,
    _to_prefetch,
)

__all__ = ["NoOffload", "OffloadActivations"]


#: the backward pass running on this thread (-1 outside one), and the engine's "run this
#: when the pass is over"
_graph_task: Callable[[], int] = torch._C._current_graph_task_id
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


@dataclass
class OffloadStats:
    """What a manager moved, since it was made: copies to the host (``to_host``, one per
    saved storage moved), the groups they were sent in (``groups``), copies back to the
    device (``to_device``, one per group brought back), their bytes, and the most bytes
    a device budget held on the device at once (``peak_held_bytes``)."""

    to_host: int = 0
    groups: int = 0
    to_host_bytes: int = 0
    to_device: int = 0
    to_device_bytes: int = 0
    peak_held_bytes: int = 0


def _end_pass(manager_ref: weakref.ref[OffloadActivations], task: int) -> None:
    manager = manager_ref()
    if manager is not None:
        manager._end_pass(task)


def _check_min_offload_size(name: str | None, value: object) -> None:
    """The one check of ``min_offload_size``, at construction and on assignment."""
    call = "OffloadActivations" if name else "OffloadActivations.min_offload_size"
    _args.count(call, name, value, 0, unit="bytes")


#: ``device_budget``'s automatic value (None means the same)
AUTO = "auto"


def _check_device_budget(name: str | None, value: object) -> int | None:
    """The one check of ``device_budget``, at construction and on assignment: the bytes,
    or None for the automatic budget (``"auto"``, or None)."""
    if value == AUTO and isinstance(value, str):
        return None
    call = "OffloadActivations" if name else "OffloadActivations.device_budget"
    return _args.count(  # type: ignore[no-any-return]
        call, name, value, 0, none=True, unit='bytes of saved activations to keep, or "auto"'
    )


#: what an explicit device budget or a goal decides for itself: (option, what it does)
_OVERRIDDEN = {
    "keep_small": "keeps the smallest storages",
    "max_fwd_stash_size": "bounds the copies in flight that hold their device tensors",
}


def _refuse_overridden(decider: str, given: dict[str, Any]) -> None:
    """An explicit device budget or a goal decides what stays on the device and lets moved
    tensors go at once: the options that do so without one are refused with it."""
    for option, value in given.items():
        if value is not None:
            raise _args.ArgumentError(
                f"OffloadActivations({decider}=..., {option}={value!r}): {option} "
                f"{_OVERRIDDEN[option]} under the automatic budget only; with {decider} it "
                f"would be ignored: leave {option} out"
            )


def _check_max_overhead(name: str | None, value: object) -> None:
    """The one check of ``max_overhead``, at construction and on assignment."""
    if value is not None:
        call = "OffloadActivations" if name else "OffloadActivations.max_overhead"
        _args.number(call, name, value, 0.0)


def _check_device_limit(name: str | None, value: object) -> None:
    """The one check of ``device_limit``, at construction and on assignment."""
    call = "OffloadActivations" if name else "OffloadActivations.device_limit"
    _args.count(call, name, value, 0, none=True, unit="bytes the step may allocate on the device")


def _check_keep_small(name: str | None, value: object) -> None:
    """The one check of ``keep_small``, at construction and on assignment."""
    _args.flag("OffloadActivations" if name else "OffloadActivations.keep_small", name, value)


def _pack_hook(manager_ref: weakref.ref[OffloadActivations]) -> Callable[[torch.Tensor], Any]:
    # Module-level closures over a weak reference: hooks bound to the instance would make
    # every OffloadActivations a reference cycle (and its pinned pool gc-only).
    def pack(t: torch.Tensor) -> Any:
        manager = manager_ref()
        return _Kept(t) if manager is None else manager._pack(t)

    return pack


#: ``packed.unpack()``: a C-level call, no Python frame per saved tensor
_unpack_hook: Callable[[Any], torch.Tensor] = operator.methodcaller("unpack")


class OffloadActivations(saved_tensors_hooks):
    """Offload activations saved for backward to host memory; the graph owns every payload.

    Args (the first four as TRL's ``OffloadActivations``):
        use_pin_memory: copy into pinned host memory (from a reusable pool) so copies can be
            asynchronous.
        use_streams: on an accelerator, copy on side streams that overlap with compute:
            device-to-host in forward on one, host-to-device prefetch in backward on
            another (so the two directions run at once).
        min_offload_size: tensors smaller than this many bytes stay where they are.
        max_fwd_stash_size: how many device-to-host copies may be in flight at once after
            their group is sent (their device tensors are kept alive until then), as TRL's.
            At least 1; default (None) 5. (A group not sent yet holds its copies' tensors
            too: at most ``batch_bytes``.) Under the automatic budget only: an explicit
            ``device_budget`` or a goal lets a moved tensor go as soon as its copy is issued
            (``record_stream`` keeps its memory safe), so giving it with one is refused.
        prefetch_bytes: how many bytes backward may have brought back ahead of their use
            (with ``use_streams``; at least one group). Default (None): twice the largest
            group the pass will bring back (a copy kept on the device does not count), so
            about two copies ahead, in whole groups. A goal's plan also brings back the
            earliest groups as backward begins (see ``max_overhead``), besides this.
            Backward prefetches in the order the previous backward of the same shape used,
            so only what it will use; the first one copies on demand. 0 turns prefetch off.
        batch_bytes: copies out smaller than this share a host block with the ones of
            their dtype saved just before and after them, up to this many bytes, and come
            back to the device with them in one transfer (one device allocation, one
            prefetch): small copies cost more in fixed overhead than in bytes. A copy this
            large or larger goes alone; 0 sends every copy alone. A group is on the device
            until it is sent and again in backward from its first use to its last, so a
            group also holds at most an eighth of what the previous forward moved (the
            first forward sends every copy alone): grouping adds at most about that to the
            device peak. Default 256 KiB.
        keep_small: under the automatic budget (default None: True; refused with an
            explicit ``device_budget`` or a goal), from the second forward on (the first
            makes the plan), the smallest saved storages stay on the device, as long as
            together they are at most 1/64 of what a forward saves (per-row statistics of
            norms, for instance): each would cost a handle, a host copy, its share of a
            transfer each way and a view in backward, and its bytes would save next to
            nothing. A saved view is weighed by its storage (a small view of a large
            storage moves). A forward of other shapes keeps at most as many small bytes
            as the plan did: what does not fit moves, and a new plan follows.
            :attr:`plan` reports them. False: every storage of at least
            ``min_offload_size`` moves (as TRL's). Settable: the next forward then plans
            again, as a first forward does.
        device_budget: bytes of saved activations to keep on the device (``"auto"``, the
            default, or None: twice the largest copy, what prefetch would bring back at
            once anyway, with ``keep_small`` and the in-flight window; 0: move every one).
            The ones backward needs first (the last saved) stay, within the budget; the
            earlier ones move. The first forward holds its saved tensors and moves the
            oldest whenever the budget is exceeded, and leaves a plan that the next
            forwards of the same shapes follow (moving as they go); a forward of other
            shapes makes a new plan. :attr:`plan` reports it, :attr:`stats` the bytes each
            way. Settable, as ``keep_small``.
        max_overhead: a goal instead of a budget: the step time offloading may add, a
            fraction of the step's compute (0.05: 5%). The first step of each shape is
            measured keeping everything on the device; the plan then moves the most bytes
            whose copies hide behind compute within it (:mod:`leakfree.offload.plan`).
        device_limit: a goal: bytes the step may allocate on the device (its allocator's
            count, parameters included). The first step of each shape is measured moving
            everything; the plan then moves the fewest bytes, costing the least time, that
            keep the step under it (nothing when it fits), and the next step checks it.
            With either goal, :attr:`plan` also says the predicted overhead and peak.
            Neither goes with ``device_budget``. Settable, as ``keep_small``.
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

    Copies out travel in groups (``batch_bytes``): a group is sent to one host block when
    it is full, when backward needs it, or at ``__exit__``, and comes back in one copy. In
    one backward pass each group comes back to the device at most once: its restored
    tensor is kept until the last handle of its copies (views of one storage saved by
    several nodes among them) has been unpacked, and let go when the pass ends at the
    latest.

    Parameters, views of parameters, what ``update_model_params`` registered (matched by
    storage address: call it again after moving the model), tensor subclasses, non-strided
    layouts and tensors with lazy conj/neg bits are never offloaded. Several views of one
    storage are copied once and restored as views of one storage again. Restored tensors
    have the original shape and strides (and storage offset, for whole-storage copies), so
    gradients are bit-identical. In-place changes to a saved tensor are reported as PyTorch
    reports them while the tensor is still on the device (kept, or its group not sent).

    ``__exit__`` sends the open groups and lets go of every device tensor kept for an
    in-flight copy (``record_stream`` where its copy still runs): the compute stream does
    not wait for the copies out, so backward begins while they run. The hooks are popped
    in ``finally``, always.

    *A forward* (what the dedup map and the plan are per) is what is saved from the
    outermost ``__enter__`` to its ``__exit__``; in one ``with`` around many steps, it
    also ends at the first save after a backward pass began unpacking this manager's
    tensors, or once most of what it recorded has died (graphs dropped without
    backward). The manager keeps at most one forward's record, so a ``with`` around a
    whole training loop keeps no more than one per step.
    """

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        min_offload_size: int = 1024,
        max_fwd_stash_size: int | None = None,
        *,
        device: torch.device | str | None = None,
        force_host_copy: bool = False,
        pin_memory_budget: int | None = None,
        prefetch_bytes: int | None = None,
        device_budget: int | str | None = AUTO,
        batch_bytes: int = 256 << 10,
        keep_small: bool | None = None,
        max_overhead: float | None = None,
        device_limit: int | None = None,
    ) -> None:
        call = "OffloadActivations"
        for name, value in (
            ("use_pin_memory", use_pin_memory),
            ("use_streams", use_streams),
            ("force_host_copy", force_host_copy),
        ):
            _args.flag(call, name, value)
        _args.count(
            call, "max_fwd_stash_size", max_fwd_stash_size, 1, none=True, unit="copies in flight"
        )
        _args.count(call, "prefetch_bytes", prefetch_bytes, 0, none=True, unit="bytes; 0: none")
        _args.count(call, "batch_bytes", batch_bytes, 0, unit="bytes; 0: every copy alone")
        _args.count(call, "pin_memory_budget", pin_memory_budget, 0, none=True, unit="bytes")
        budget = _check_device_budget("device_budget", device_budget)
        _check_max_overhead("max_overhead", max_overhead)
        _check_device_limit("device_limit", device_limit)
        if budget is not None and (max_overhead is not None or device_limit is not None):
            other = "max_overhead" if max_overhead is not None else "device_limit"
            raise _args.ArgumentError(
                f"OffloadActivations(device_budget=..., {other}=...): a device budget fixes "
                f"the bytes kept, {other} plans them from a measured step: give one of the two"
            )
        if keep_small is not None:
            _check_keep_small("keep_small", keep_small)
        decider = "device_budget" if budget is not None else None
        decider = "max_overhead" if max_overhead is not None else decider
        decider = "device_limit" if device_limit is not None else decider
        if decider is not None:
            given = {"keep_small": keep_small, "max_fwd_stash_size": max_fwd_stash_size}
            _refuse_overridden(decider, given)
        _check_min_offload_size("min_offload_size", min_offload_size)
        target = _args.device(call, "device", device) if device is not None else accelerator()
        if target is None and force_host_copy:
            target = torch.device("cpu")
        if target is not None and target.type == "cpu" and not force_host_copy:
            raise ValueError(
                "OffloadActivations(device='cpu'): offloading CPU tensors to CPU only makes "
                "sense to exercise the path; pass force_host_copy=True for that"
            )
        self.device: torch.device | None = target
        accelerated = target is not None and target.type != "cpu"
        self.use_streams = use_streams and accelerated
        self.use_pin_memory = use_pin_memory and accelerated
        self.min_offload_size = min_offload_size
        self.max_fwd_stash_size = 5 if max_fwd_stash_size is None else max_fwd_stash_size
        self.prefetch_bytes = prefetch_bytes
        #: what moves and what stays: the settings, and the plan of the last forward
        self._planner = Planner(
            device_budget=budget,
            keep_small=True if keep_small is None else keep_small,
            max_overhead=max_overhead,
            device_limit=device_limit,
            batch_bytes=batch_bytes,
        )
        #: a step being measured for a goal's plan; the bandwidths each way, once measured;
        #: under a limit, what the device held as the step checked against it began
        self._measuring: StepMeasure | None = None
        self._bandwidth: tuple[float, float] | None = None
        self._checking: int | None = None
        self._small_room = 0  # of those bytes, what this forward has not kept yet
        #: whether moved tensors stay on the device while their copies are in flight
        self._window = self.use_streams and budget is None and not self._planner.goal
        self._device_type = target.type if target is not None else None  # for the pack hook
        self.pool = HostBlockPool(pin_memory_budget, pin=self.use_pin_memory)
        self._device_module: Any = device_module(target) if accelerated and target else None
        #: force_host_copy on the CPU: the "device" is the host itself, so copies out are
        #: plain host copies and restored tensors view the host bytes (no copy back)
        self._on_host = target is not None and target.type == "cpu"
        #: (device, direction) -> its side stream: one for copies out and one for prefetch
        #: back per device, so the two directions run at once (a stream runs in order)
        self._side_streams: dict[tuple[torch.device, bool], Any] = {}
        self._param_storages: frozenset[int] = frozenset()
        self._forward = _Forward()  # what this forward saved, for dedup and the plan
        self._depth = 0
        self._in_flight: deque[Flight] = deque()
        self._lock = threading.RLock()  # backward may unpack on several device threads
        self._ref = weakref.ref(self)  # what handles hold
        self._copies = _Copies()
        #: the groups copies join, one per dtype and device (weakly: a graph dropped
        #: mid-forward frees its group, and the bytes it would send)
        self._open: dict[tuple[torch.dtype, torch.device], weakref.ref[_Group]] = {}
        #: backward passes under way (graph task id -> its state), and the order the last
        #: finished pass used, which the next pass of the same shape prefetches in
        self._passes: dict[int, _Pass] = {}
        self._order: Order = ()
        #: a device budget's state: copies held on the device (weakly, oldest first, with
        #: sizes) and their bytes; this forward's copy sizes; the plan (sizes, how many
        #: move) from the last forward, and whether this forward still matches it
        self._held: deque[tuple[weakref.ref[_HostCopy], int]] = deque()
        self._held_bytes = 0
        #: a forward whose plan moves nothing keeps its saved tensors as they are: by
        #: storage, the tensors kept of it (weakly: the storage is kept while one lives)
        #: with its bytes (this forward's, by storage: ``_forward.kept``); the bytes kept;
        #: and whether it still does
        self._kept: list[tuple[list[weakref.ref[_Kept]], int]] = []
        self._kept_bytes = 0
        self._keep_all = False
        self._on_plan = False  # this forward still follows the plan
        self.stats = OffloadStats()
        self.enabled = target is not None
        super().__init__(_pack_hook(self._ref), _unpack_hook)

    # -- configuration ------------------------------------------------------------------

    @property
    def min_offload_size(self) -> int:
        """Tensors smaller than this many bytes stay where they are (settable)."""
        return self._min_offload_size

    @min_offload_size.setter
    def min_offload_size(self, value: int) -> None:
        _check_min_offload_size(None, value)
        self._min_offload_size = value
        self._min_bytes = max(value, 1)  # what the pack hook compares, precomputed

    @property
    def batch_bytes(self) -> int:
        """Copies smaller than this share a host block and a transfer (see the class)."""
        return self._planner.batch_bytes

    @property
    def device_budget(self) -> int | str:
        """Bytes of saved activations to keep on the device, or ``"auto"`` (settable: the
        next forward then plans again, as a first forward does)."""
        budget = self._planner.device_budget
        return AUTO if budget is None else budget

    @device_budget.setter
    def device_budget(self, value: int | str | None) -> None:
        budget = _check_device_budget(None, value)
        if budget is not None and self._planner.goal:
            raise _args.ArgumentError(
                f"OffloadActivations.device_budget = {value!r}: max_overhead or "
                "device_limit is set; set them to None first"
            )
        self._set("device_budget", budget)

    @property
    def max_overhead(self) -> float | None:
        """The step time offloading may add, a fraction of the step's compute (settable:
        the next step is measured and planned again)."""
        return self._planner.max_overhead

    @max_overhead.setter
    def max_overhead(self, value: float | None) -> None:
        _check_max_overhead(None, value)
        self._no_budget_with_goal(value)
        self._set("max_overhead", value)

    @property
    def device_limit(self) -> int | None:
        """Bytes the step may allocate on the device (settable: the next step is measured
        and planned again)."""
        return self._planner.device_limit

    @device_limit.setter
    def device_limit(self, value: int | None) -> None:
        _check_device_limit(None, value)
        self._no_budget_with_goal(value)
        self._set("device_limit", value)

    def _no_budget_with_goal(self, value: object) -> None:
        if value is not None and self._planner.device_budget is not None:
            raise _args.ArgumentError(
                "OffloadActivations: a goal (max_overhead, device_limit) with a "
                "device_budget set: set device_budget = None first"
            )

    @property
    def keep_small(self) -> bool:
        """Whether the plan keeps the smallest saved storages on the device (settable: the
        next forward then plans again, as a first forward does)."""
        return self._planner.keep_small

    @keep_small.setter
    def keep_small(self, value: bool) -> None:
        _check_keep_small(None, value)
        planner = self._planner
        if planner.device_budget is not None or planner.goal:
            raise _args.ArgumentError(
                f"OffloadActivations.keep_small = {value!r}: keeps the smallest storages "
                "under the automatic budget only; device_budget or a goal is set"
            )
        self._set("keep_small", value)

    def _set(self, name: str, value: object) -> None:
        """Set the planner's ``name`` (checked); a change makes the next forward plan, or
        be measured, again, as a first forward is."""
        planner = self._planner
        with self._lock:
            if value != getattr(planner, name):
                planner.forget()
                self._measuring = None
                self._checking = None
            setattr(planner, name, value)
            self._window = self.use_streams and planner.device_budget is None and not planner.goal

    def update_model_params(self, model: nn.Module) -> None:
        """Never offload ``model``'s parameters and buffers (matched by storage address).

        Addresses change when the model moves (``.to()``) or its storage is re-created:
        call it again then.
        """
        _args.module("OffloadActivations.update_model_params", "model", model)
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

    def _pack(self, t: torch.Tensor) -> Any:
        # Runs for every saved tensor: the checks go cheapest first, and the common path
        # (a new storage, copied whole) makes no call it can avoid.
        if (
            not self.enabled
            or type(t) is not torch.Tensor  # not Parameters, not subclasses
            or t.device.type != self._device_type
            or t.layout != torch.strided  # no sizes to span, no byte view to copy through
            or t.is_nested
            or t.nbytes < self._min_bytes
            or t.is_quantized
            or t.is_conj()  # lazy bits
            or t.is_neg()
        ):
            return _Kept(t)  # stays where it is, as plain PyTorch would keep it
        base = t._base  # (isinstance against Parameter runs Python: only for views of
        # something other than a plain tensor, which no Parameter is)
        if base is not None and type(base) is not torch.Tensor and isinstance(base, nn.Parameter):
            return _Kept(t)  # weight.t() and the like
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._param_storages:
            return _Kept(t)
        total = storage.nbytes()
        version = t._version
        forward = self._forward
        if forward.over or forward.records > forward.mark:
            forward = self._next_forward()
        if total < self._planner.small_below and self._small_stays((ptr, version, total)):
            return _Kept(t)  # too small to be worth moving: see _end_forward
        if self._keep_all:  # the plan moves nothing: kept as it is, its bytes counted
            kept = self._keep(t, (ptr, version, total))
            if kept is not None:
                return kept
        elem = t.element_size()
        first = int(t.storage_offset())
        contiguous = t.is_contiguous()
        if contiguous:  # the common case, without a walk over the strides
            end = first + t.numel()
        else:
            first, end = _span(t)
        span_bytes = (end - first) * elem
        whole = total <= 2 * span_bytes
        with self._lock:
            shared = forward.shared
            copy = None
            if whole:  # another view of this storage at this version, saved in this forward
                ref = shared.get((ptr, version))
                copy = ref() if ref is not None else None
                if copy is not None and (copy.source is None or copy.source() is None):
                    copy = None  # its storage died: the address was reused
            same = False  # t is exactly the copy's bytes: see _Offloaded.same
            if copy is None:
                copy = _HostCopy(
                    total if whole else span_bytes, 0 if whole else first * elem, t.device
                )
                copy.version = version
                ref = self._copies.add(copy)  # numbers it
                forward.record(copy)
                if whole:
                    if total % elem == 0:
                        copy.dtype = t.dtype
                        if first == 0 and contiguous and span_bytes == total:
                            copy.like = (t.dtype, t.shape)
                            same = True
                    copy.source = weakref.ref(storage)
                    shared[(ptr, version)] = ref
                sizes = forward.sizes
                if not whole:  # the small-storage rule weighs the storage it keeps
                    forward.spans[len(sizes)] = (ptr, version, total)
                sizes.append(copy.nbytes)  # this forward's copies, for the plan
                if self._measuring is not None:  # when it was saved, for the plan
                    self._measuring.saved()
                planner = self._planner
                if planner.plan is None and planner.device_budget is None and not planner.goal:
                    self._copy_out(t, copy, ref)  # a first forward with no budget: all move
                else:
                    self._budgeted(copy, t, ref)
            else:  # a copy made for an earlier save: is t exactly its bytes too?
                like = copy.like
                same = (
                    like is not None
                    and first == 0
                    and contiguous
                    and like[0] is t.dtype
                    and like[1] == t.shape
                )
            offset = first - copy.byte_start // elem
            return _Offloaded(self._ref, copy, t, offset, same)  # type: ignore[arg-type]

    def _small_stays(self, key: tuple[int, int, int]) -> bool:
        """Whether a storage under the plan's ``_small_below`` (``key``: its address,
        version and bytes) stays where it is: while this forward's small storages fit in
        the bytes the plan kept for them. A forward of other shapes may save more, or its
        activations may have shrunk under the mark: what does not fit moves, and the
        forward's copies then differ from the plan, which makes a new one. (Forward-only
        state, reset by ``__enter__`` and read by ``_end_forward``.)"""
        small = self._forward.small
        if key not in small:  # saved again (another view, another node): counted once
            if key[2] > self._small_room:
                return False
            self._small_room -= key[2]
            small[key] = key[2]
        return True

    # -- a device budget ------------------------------------------------------------------

    def _budgeted(self, copy: _HostCopy, t: torch.Tensor, ref: weakref.ref[_HostCopy]) -> None:
        """Keep ``copy`` on the device or move it, as the plan says; then move the oldest
        held copies until the held bytes fit the budget again, and send the open groups if
        their bytes, still on the device, do not fit beside them."""
        plan = self._planner.plan
        i = len(self._forward.sizes) - 1  # this copy's place in the forward
        if self._on_plan and plan is not None and i < len(plan[0]) and plan[0][i] == copy.nbytes:
            if i < plan[1]:  # the plan moves it: at once, as the forward goes
                self._copy_out(t, copy, ref)
                if self._planner.device_budget is not None:
                    self._within_budget()
                return
        else:
            self._on_plan = False  # another shape: hold, and move the oldest as needed
        copy.pending = t.detach()
        self._held.append((ref, copy.nbytes))
        self._held_bytes += copy.nbytes
        budget = self._budget() - self._kept_bytes
        while self._held_bytes > budget and self._held:
            old_ref, nbytes = self._held.popleft()
            self._held_bytes -= nbytes
            old = old_ref()
            if old is None or old.pending is None:
                continue
            held = old.pending
            if held._version != old.version:
                continue  # written in place since: its unpack reports it, as PyTorch would
            old.pending = None
            self._copy_out(held, old, old_ref)
        self._within_budget()

    def _within_budget(self) -> None:
        """Under a device budget, send the open groups if their bytes (still on the device)
        and the held and kept ones pass it. (Without one, what the plan keeps is only
        what prefetch would bring back anyway: a group is sent when full.)"""
        total = self._held_bytes + self._kept_bytes
        budget = self._planner.device_budget
        if budget is not None:
            groups = self._open_groups()
            unsent = sum(group.used for group in groups)
            if total + unsent > budget:
                for group in groups:
                    self._send(group)
            else:
                total += unsent
        self.stats.peak_held_bytes = max(self.stats.peak_held_bytes, total)

    def _open_groups(self) -> list[_Group]:
        """The groups waiting to be sent, oldest first (lock held)."""
        groups = []
        for ref in self._open.values():
            group = ref()
            if group is not None:
                groups.append(group)
        return groups

    def _keep(self, t: torch.Tensor, key: tuple[int, int, int]) -> Any:
        """A forward whose plan moves nothing: ``t`` stays as any kept tensor does, with no
        copy object, while the bytes kept fit the budget; past it, the rest of the forward
        is handled as under any budget, the kept bytes a floor nothing moves. Counted by
        storage (``key``: address, version, bytes), as the plan counts its copies: a
        storage saved by several nodes counts once, a view counts its whole storage."""
        with self._lock:
            forward = self._forward
            refs = forward.kept.get(key)
            if refs is None:
                if self._kept_bytes + key[2] > self._budget():
                    self._keep_all = self._on_plan = False  # outgrown: held and moved
                    return None
                self._kept_bytes += key[2]
                refs = forward.kept[key] = []
                self._kept.append((refs, key[2]))
            kept = _Kept(t)
            refs.append(weakref.ref(kept))  # the storage is kept while one of them lives
            forward.record(kept)
            return kept

    def _forget_dead_held(self) -> None:
        """Drop the held copies whose graph is gone (used, or dropped) from the count."""
        live = deque(e for e in self._held if (c := e[0]()) is not None and c.pending is not None)
        self._held = live
        self._held_bytes = sum(n for _, n in live)
        # an earlier forward's, still kept by its graph
        kept = [e for e in self._kept if any(r() is not None for r in e[0])]
        self._kept = kept
        self._kept_bytes = sum(n for _, n in kept)

    def _budget(self) -> int:
        """The bytes of saved activations this forward keeps on the device (the planner's
        budget: see :meth:`Planner.budget`)."""
        return self._planner.budget(on_plan=self._on_plan)

    def _end_forward(self) -> None:
        """A forward ended: plan the next from its copy sizes, unless it followed the plan
        (a goal's plan is made once the step is measured, at the end of its backward; a
        forward of other shapes makes the next one measured)."""
        forward = self._forward
        sizes, spans, small = forward.sizes, forward.spans, forward.small
        planner = self._planner
        if not sizes or (planner.plan is not None and tuple(sizes) == planner.plan[0]):
            return
        if planner.goal:
            measuring = self._measuring
            if measuring is not None and measuring.sizes is None:
                measuring.forward_done(tuple(sizes))
            else:
                planner.forget()
                self._measuring = None
            return
        # each copy's storage bytes (a span's storage may be larger than the span), and
        # every storage the forward saved, once: whole copies are one per storage (the
        # dedup map), spans of one storage or of a storage copied whole count once more
        storages = [spans[i][2] if i in spans else n for i, n in enumerate(sizes)]
        shared = forward.shared
        saved = [n for i, n in enumerate(sizes) if i not in spans]
        saved += [key[2] for key in set(spans.values()) if key[:2] not in shared]
        saved += small.values()
        planner.from_forward(sizes, storages, saved)

    @property
    def plan(self) -> OffloadPlan | None:
        """What stays on the device and what moves per forward, and what a goal's plan
        predicts (None before the first forward ends, or a goal's first step)."""
        return self._planner.report()

    # -- a goal: measure one step, then plan ------------------------------------------------

    def _plan_measured(self, measuring: StepMeasure) -> None:
        """The measured step's backward is over (lock held): the plan for its shapes, from
        what it measured (one host wait, for its last mark, and the bandwidth probe once)."""
        self._measuring = None
        measured = measuring.finish(self.stats.to_host_bytes, self._probe)
        if measured is None:  # saves the plan did not see: the next step is measured
            return
        measurement, rises = measured
        planner = self._planner
        checkable = measuring.module is not None
        planner.adopt(measurement, measuring.allocated, checkable=checkable)
        planner.rises = rises
        planner.replans += 1

    def _probe(self, nbytes: int) -> tuple[float, float]:
        """The copy bandwidths each way (measured once, with ``nbytes``)."""
        if self._bandwidth is None:
            module = self._device_module
            device = cast(torch.device, self.device)
            if module is not None and self.use_streams:
                streams = (self._side(device, False), self._side(device, True))
            elif module is not None:
                current = module.current_stream(device)
                streams = (current, current)
            else:
                streams = (None, None)
            self._bandwidth = bandwidth(device, module, streams, nbytes)
        return self._bandwidth

    def _check_start(self) -> None:
        """A step under a limit's new plan begins (lock held): its peak is read at its end."""
        module, device = self._device_module, self.device
        module.reset_peak_memory_stats(device)
        self._checking = int(module.memory_allocated(device))

    def _check_end(self) -> None:
        """The checked step is over (lock held): the planner weighs its peak."""
        self._checking = None
        self._planner.checked(int(self._device_module.max_memory_allocated(self.device)))

    # -- copies -----------------------------------------------------------------------------

    def _copy_out(self, t: torch.Tensor, copy: _HostCopy, ref: weakref.ref[_HostCopy]) -> None:
        """Move ``copy`` (``ref``: a weak reference to it) of ``t``'s storage to the host:
        it joins the open group (sent once full, or at ``__exit__``), or goes at once in a
        group of its own."""
        # Until sent, the group holds t as it is (a saved output's grad_fn then holds the
        # group back, through this copy's handle: a cycle that sending breaks, at the
        # latest at __exit__, which sends the open group).
        if copy.like is not None:
            # t is its whole storage: copied as it is, host side viewed to match (one op on
            # the device, where a byte view of the storage costs two more)
            src = t
        elif copy.dtype is t.dtype:  # the bytes, seen flat through t's dtype
            elem = t.element_size()
            src = t.as_strided((copy.nbytes // elem,), (1,), copy.byte_start // elem)
        else:
            src = _bytes_of(t.untyped_storage(), copy.device, copy.byte_start, copy.nbytes)
        stats = self.stats
        stats.to_host += 1
        stats.to_host_bytes += copy.nbytes
        # One open group per dtype and device: the float32 statistics a mixed-precision
        # layer saves between its bfloat16 activations do not close each other's groups.
        key = (copy.dtype, copy.device)
        opened = self._open.get(key)
        group = opened() if opened is not None else None
        if group is not None and group.fits(copy):
            group.add(copy, ref, src, t)
            return
        capacity = self._planner.capacity
        if copy.nbytes >= capacity:  # alone, at once; the open group stays open
            group = _Group(copy.nbytes, copy.dtype, copy.device)
            group.add(copy, ref, src, t)
            self._send(group)
            return
        if group is not None:
            self._send(group)  # full: off it goes
        group = _Group(capacity, copy.dtype, copy.device)
        group.add(copy, ref, src, t)
        self._open[key] = weakref.ref(group)

    def _send(self, group: _Group) -> None:
        """Copy the group's bytes to a host block of their size, on the side stream where
        there is one (after the compute stream, which made them), with one event for all."""
        key = (group.dtype, group.device)
        opened = self._open.get(key)
        if opened is not None and opened() is group:
            del self._open[key]
        block, pairs = group.take_block(self.pool)
        group.sent = self.stats.groups  # copies out run in this order
        self.stats.groups += 1
        # Outside the pack hook (a full group, __exit__) autograd would record a copy
        # from t: grad mode off, as torch.no_grad() does, in two calls.
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            if self._on_host:
                for dst, src in pairs:
                    dst.copy_(src)
                return
            device = group.device
            module = self._device_module
            side = None
            if self.use_streams:
                side = self._side_streams.get((device, False)) or self._side(device, False)
            if side is not None:
                side.wait_stream(module.current_stream(device))  # the activations are made
            with module.stream(side):  # stream(None): stay on the current one
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=block.pinned)
                # the pool hands the block out again only once these copies have completed
                block.event = group.written = module.current_stream(device).record_event()
        finally:
            torch._C._set_grad_enabled(grad)
        if side is None or not block.pinned:
            return  # on the current stream, or synchronous: nothing to keep
        if self._window:
            # The device tensors stay alive until their copies retire.
            window = self._in_flight
            event = group.written
            for _, src in pairs:
                window.append((src, event))
            excess = len(window) - self.max_fwd_stash_size
            if excess > 0:  # the oldest retire
                self._let_go([window.popleft() for _ in range(excess)])
        else:
            # Let go of at once (a device budget, which counts them no more): the allocator
            # must not hand this memory to anyone before the copies ran.
            for _, src in pairs:
                src.record_stream(side)

    def _restore(self, handle: _Offloaded) -> torch.Tensor:
        """``handle``'s tensor on the device, viewing its group's device tensor: the one
        this pass keeps, a live restored one, the prefetched one, or a new copy in.

        Runs for every unpacked handle: the pass's bookkeeping is written out here rather
        than in helpers. In a pass (``task`` >= 0) the first unpack of a group records its
        place in the order; the restored tensor is kept (``group.keep``) until the last
        handle of the group's copies has been unpacked, and the groups the learned order
        needs next are prefetched."""
        copy = handle.copy
        group = copy.group
        if group is None:  # unreachable: a handle without a group is held on the device
            raise RuntimeError("leakfree: an offloaded tensor has no host copy; please report this")
        task = _graph_task()
        with self._lock:
            if group.block is None:  # needed before its forward ended: send it now
                self._send(group)
            state = None
            if task >= 0:
                state = self._passes.get(task) or self._pass(task, group)
            kept = group.keep if group.task == task else None
            if kept is not None:
                dev = kept
            else:
                sibling = group.live_restored() if group.restored is not None else None
                if sibling is not None:  # a sibling's, from another pass: maybe another stream
                    dev, event = sibling
                    if event is not None:
                        self._use_here(dev, event)
                else:
                    if group.prefetched is not None:
                        dev, event = group.prefetched
                        group.prefetched = None
                        early = state.early if state is not None else None
                        if state is not None and (early is None or group.seq not in early):
                            state.outstanding -= group.used
                        self._use_here(dev, event)
                    else:
                        dev, event = self._copy_in(group)
                    # a later pass may find it alive (a double-backward graph keeps it)
                    group.restored = (weakref.ref(dev.untyped_storage()), event)
            if state is not None:
                if group.task != task:  # the first unpack of this group in this pass
                    group.task = task
                    group.remaining = group.users
                    state.order.append((group.seq, group.used))
                    state.held.append(weakref.ref(group))
                    if self._measuring is not None:
                        self._measuring.sample(group.used, moved=True)
                    if state.plan and self.use_streams and self._planner.early:
                        self._prefetch_early(state, group)
                    if state.plan and self.use_streams:  # what the order needs next
                        window = self.prefetch_bytes
                        if window is None:
                            window = state.window
                        if window:
                            for ahead in _to_prefetch(state, group, window):
                                ahead.prefetched = self._copy_in(ahead, prefetch=True)
                                state.prefetched.append(weakref.ref(ahead))
                if handle.task != task:
                    handle.task = task
                    group.remaining -= 1
                # One view per geometry while the pass keeps the group (a tensor saved by
                # several nodes: a view op, and its Python, for the first one only)
                views = group.views
                if group.remaining > 0:
                    group.keep = dev
                    if views is None:
                        views = group.views = {}
                else:  # its last handle: what it kept goes (after this last look)
                    group.keep = group.views = None
            else:
                views = None
            if handle.same and group.like is not None:  # the group's tensor is the handle's
                return dev
            if views is None:
                return handle.view_of(dev, copy.offset, False)
            key = (copy.offset, handle.element_offset, handle.shape, handle.stride, handle.dtype)
            out = views.get(key)
            if out is None:
                out = views[key] = handle.view_of(dev, copy.offset, False)
            return out

    def _prefetch_early(self, state: _Pass, first: _Group | _HostCopy) -> None:
        """Bring back up to ``_early`` bytes of this pass's groups ahead of their turn
        (lock held; ``first``: what the pass is unpacking now): the ones sent first, whose
        copies out ended first (the forward's earliest activations, which backward needs
        last), in the order sent, so the copy back engine works while the last copies out
        run and never waits for a later one. Paced by what backward frees: each
        comes once the device's allocated bytes leave room for it under the plan's ceiling
        (``device_limit``, or the peak the plan predicts), so the step's peak does not
        grow; they do not count against the prefetch window."""
        if state.early is None:  # the pass begins: its queue, once
            state.early = set()
            sent = [r() for r in state.plan]
            chosen = [g for g in sent if isinstance(g, _Group) and g is not first and g.block]
            budget = self._planner.early
            for candidate in sorted(chosen, key=lambda g: g.sent):
                if candidate.used > budget:
                    break
                budget -= candidate.used
                state.early_queue.append(weakref.ref(candidate))
        queue = state.early_queue
        if not queue:
            return
        device = cast(torch.device, self.device)
        allocated = int(self._device_module.memory_allocated(device))
        position = len(state.order) - 1
        rises = self._planner.rises
        ceiling = self._planner.ceiling - (rises[position] if position < len(rises) else 0)
        while queue:
            group = queue[0]()
            if group is not None and allocated + group.used > ceiling:
                return  # no room yet: the next first unpack looks again
            queue.pop(0)
            if (
                group is None
                or group.prefetched is not None
                or group.block is None
                or (group.restored is not None and group.restored[0]() is not None)
            ):
                continue
            allocated += group.used
            group.prefetched = self._copy_in(group, prefetch=True)
            state.prefetched.append(weakref.ref(group))
            state.early.add(group.seq)

    def _note(self, copy: _HostCopy) -> None:
        """A copy held on the device was unpacked: its place in this pass's order (so the
        order of the next pass lines up, whichever copies it holds)."""
        task = _graph_task()
        if task < 0 or copy.task == task:
            return
        with self._lock:
            state = self._pass(task, copy)
            copy.task = task
            state.order.append((copy.seq, copy.nbytes))
            if self._measuring is not None:
                self._measuring.sample(copy.nbytes, moved=False)
            if state.plan and self._planner.early and self.use_streams:
                self._prefetch_early(state, copy)

    def _pass(self, task: int, first: _Group | _HostCopy) -> _Pass:
        """The state of backward pass ``task`` (lock held); begun by its first unpack, of
        ``first``: it follows the order learned last time, and ends in a callback."""
        state = self._passes.get(task)
        if state is None:
            self._forward.over = True  # the next save outside a pass begins a new forward
            state = self._passes[task] = _Pass()
            if self._measuring is not None:
                self._measuring.backward_begins()
            _follow(self._order, first, self._copies, state)
            _queue_callback(functools.partial(_end_pass, self._ref, task))
        return state

    def _end_pass(self, task: int) -> None:
        """The pass is over: drop what it kept and prefetched, learn the order it used."""
        with self._lock:
            state = self._passes.pop(task, None)
            if state is None:
                return
            for ref in state.held:
                group = ref()
                if group is not None and group.task == task:
                    group.keep = group.views = None
            for ref in state.prefetched:
                group = ref()
                if group is not None and group.prefetched is not None:
                    # brought back and never used: freed (the side stream's memory, which
                    # only its later work reuses)
                    group.prefetched = None
            if state.order:
                self._order = state.learned()
            measuring = self._measuring
            if measuring is not None and measuring.backward is not None:
                self._plan_measured(measuring)
            elif self._checking is not None:
                self._check_end()

    def _copy_in(self, group: _Group, *, prefetch: bool = False) -> tuple[torch.Tensor, Any]:
        """Bring ``group``'s bytes back: needed now, on the current stream (after the copies
        out); ahead of use, on the side stream, into memory of the current stream (the
        side waits for the current stream first, as that memory may be its own; the
        consumer then waits for the copy's event: nothing to record on either stream).
        """
        host = group.on_host()  # raises unless the group was sent: it has its block
        block = cast(HostBlock, group.block)
        if self._on_host:
            # the host bytes are already where the tensor lives, so restored tensors view
            # them (no copy back); the block then stays theirs and is never handed out again
            group.lent = True
            return host, None
        stats = self.stats
        stats.to_device += 1
        stats.to_device_bytes += group.used
        module = self._device_module
        current = module.current_stream(group.device)
        if prefetch and self.use_streams:
            side = self._side_streams.get((group.device, True)) or self._side(group.device, True)
            if group.written is not None:  # the copy out, on the other side stream
                side.wait_event(group.written)
            with module.stream(side):  # the side stream's memory: waits for nothing else
                dev = torch.empty(host.shape, dtype=host.dtype, device=group.device)
                dev.copy_(host, non_blocking=block.pinned)
                event = side.record_event()
        else:
            if group.written is not None:
                current.wait_event(group.written)
            dev = group.to_device(non_blocking=block.pinned)
            event = current.record_event()
        block.event = event  # the host block is read until this completes
        return dev, event

    def _let_go(self, flights: list[Flight]) -> None:
        """End the in-flight window's hold of device tensors whose copies out recorded
        their events, before the compute stream waits for them. A tensor whose copy is
        done (its event says so: the common case) is let go as it is; else
        ``record_stream`` makes the allocator wait for the side stream first."""
        seen, running = None, False  # the last event asked (a group's copies share one)
        for t, event in flights:
            if event is not seen:
                seen, running = event, not event.query()
            if running:
                t.record_stream(self._side(t.device, False))

    def _use_here(self, dev: torch.Tensor, event: Any) -> None:
        """Make ``dev``, written on another stream up to ``event``, usable on the current
        stream: wait for the write, and keep the allocator from reusing the memory before
        this stream is done with it."""
        current = self._device_module.current_stream(dev.device)
        current.wait_event(event)
        dev.record_stream(current)

    def _side(self, device: torch.device, back: bool) -> Any:
        """The side stream of ``device`` for copies out (``back`` False) or prefetch back
        (True): made on first use, and kept under the device as given and with its index,
        so a tensor's own ``device`` finds it in one look-up."""
        indexed = torch.device(device.type, device_index(device))
        side = self._side_streams.get((indexed, back))
        if side is None:
            side = self._side_streams[(indexed, back)] = self._device_module.Stream(device=indexed)
        self._side_streams[(device, back)] = side
        return side

    # -- context ------------------------------------------------------------------------------

    def _begin_forward(self) -> None:
        """A forward begins (lock held): the small storages it may keep, and whether it
        follows the plan, start over; the held copies and kept storages whose graphs are
        gone no longer count. (Its record, ``_forward``, is fresh.)"""
        planner = self._planner
        self._small_room = planner.small_kept[1]
        self._on_plan = True
        plan = planner.plan
        if planner.goal and plan is None:
            device = cast(torch.device, self.device)
            self._measuring = StepMeasure(device, self._device_module, self.stats.to_host_bytes)
        elif planner.check is not None and self._device_module is not None:
            self._check_start()
        self._keep_all = plan is not None and plan[1] == 0
        if self._held or self._kept:
            self._forget_dead_held()

    def _close_forward(self) -> None:
        """The forward is over (lock held): its open groups are sent (a group holds one
        forward's copies), the next forward's plan is made from it, and its record is
        dropped. Earlier forwards' handles keep their own copies."""
        for group in self._open_groups():
            self._send(group)
        self._open.clear()
        self._end_forward()
        held = self._held_bytes + self._kept_bytes
        self.stats.peak_held_bytes = max(self.stats.peak_held_bytes, held)
        self._forward = _Forward()

    def _next_forward(self) -> _Forward:
        """The pack hook's record is due a look (one ``with`` around many steps): a
        backward pass began unpacking this manager's tensors, or the record has grown past
        its mark. A new forward begins with this save, unless the save is made by a
        backward pass (double backward, recomputation: it belongs to the graph it
        extends) or most of what the record holds is still alive."""
        with self._lock:
            forward = self._forward
            if forward.over:
                if _graph_task() >= 0:
                    return forward
            elif not forward.outlived():
                return forward
            self._close_forward()
            self._begin_forward()
            return self._forward

    def __enter__(self) -> OffloadActivations:  # type: ignore[override]
        with self._lock:
            if self._depth == 0:  # nested entries of the same instance share the forward
                self._begin_forward()
            self._depth += 1
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._close_forward()
                # The window's tensors go: those whose copies are still running are
                # recorded on the side stream, so the compute stream never waits for the
                # copies out here (backward may begin while they run: only the copies
                # back of their groups wait for them).
                self._let_go(list(self._in_flight))
                self._in_flight.clear()
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
