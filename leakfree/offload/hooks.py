"""The context managers: :class:`OffloadActivations` and :class:`NoOffload`.

:class:`OffloadActivations`'s pack hook returns a handle (:mod:`leakfree.offload.handles`)
that the graph owns. The manager is assembled from one part per concern, each in its own
module, over the state :mod:`leakfree.offload.state` declares: the copies and their
streams (:mod:`~leakfree.offload.transfers`), what stays on the device and the plans
(:mod:`~leakfree.offload.keeping`, deciding with :mod:`~leakfree.offload.plan`), and
backward's passes (:mod:`~leakfree.offload.backward`). This module has the hooks, the
settings' checks and the forward's bounds. :class:`NoOffload` keeps saved tensors where
they are.
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

import leakfree._args as _args
from leakfree._device import accelerator, device_module
from leakfree.offload.backward import _Backward
from leakfree.offload.handles import (
    _Forward,
    _Group,
    _HostCopy,
    _Kept,
    _Offloaded,
    _span,
)
from leakfree.offload.keeping import (
    AUTO,
    _check_device_budget,
    _check_device_limit,
    _check_keep_small,
    _check_max_overhead,
    _refuse_overridden,
)
from leakfree.offload.measure import StepMeasure
from leakfree.offload.plan import Planner
from leakfree.offload.pool import HostBlockPool
from leakfree.offload.state import OffloadStats, _graph_task
from leakfree.offload.streams import (
    Flight,
    Order,
    _Copies,
    _Pass,
)

__all__ = ["NoOffload", "OffloadActivations"]


def _check_min_offload_size(name: str | None, value: object) -> None:
    """The one check of ``min_offload_size``, at construction and on assignment."""
    call = "OffloadActivations" if name else "OffloadActivations.min_offload_size"
    _args.count(call, name, value, 0, unit="bytes")


def _checked(
    use_pin_memory: object,
    use_streams: object,
    min_offload_size: object,
    max_fwd_stash_size: object,
    device: object,
    force_host_copy: object,
    pin_memory_budget: object,
    prefetch_bytes: object,
    device_budget: object,
    batch_bytes: object,
    keep_small: object,
    max_overhead: object,
    device_limit: object,
) -> tuple[int | None, torch.device | None]:
    """Every argument of :class:`OffloadActivations` checked, before any state exists:
    the device budget (None: the automatic one) and the device offloaded from."""
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
    return budget, target


def _pack_hook(manager_ref: weakref.ref[OffloadActivations]) -> Callable[[torch.Tensor], Any]:
    # Module-level closures over a weak reference: hooks bound to the instance would make
    # every OffloadActivations a reference cycle (and its pinned pool gc-only).
    def pack(t: torch.Tensor) -> Any:
        manager = manager_ref()
        return _Kept(t) if manager is None else manager._pack(t)

    return pack


#: ``packed.unpack()``: a C-level call, no Python frame per saved tensor
_unpack_hook: Callable[[Any], torch.Tensor] = operator.methodcaller("unpack")


class OffloadActivations(_Backward, saved_tensors_hooks):
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
        budget, target = _checked(
            use_pin_memory, use_streams, min_offload_size, max_fwd_stash_size, device,
            force_host_copy, pin_memory_budget, prefetch_bytes, device_budget, batch_bytes,
            keep_small, max_overhead, device_limit,
        )  # fmt: skip
        self.device: torch.device | None = target
        accelerated = target is not None and target.type != "cpu"
        self.use_streams = use_streams and accelerated
        self.use_pin_memory = use_pin_memory and accelerated
        self.min_offload_size = min_offload_size
        self.max_fwd_stash_size = 5 if max_fwd_stash_size is None else max_fwd_stash_size
        self.prefetch_bytes = prefetch_bytes
        self._planner = Planner(
            device_budget=budget,
            keep_small=True if keep_small is None else keep_small,
            max_overhead=max_overhead,
            device_limit=device_limit,
            batch_bytes=batch_bytes,
        )
        self._measuring: StepMeasure | None = None
        self._bandwidth: tuple[float, float] | None = None
        self._checking: int | None = None
        self._small_room = 0
        self._window = self.use_streams and budget is None and not self._planner.goal
        self._device_type = target.type if target is not None else None
        self.pool = HostBlockPool(pin_memory_budget, pin=self.use_pin_memory)
        self._device_module: Any = device_module(target) if accelerated and target else None
        self._on_host = target is not None and target.type == "cpu"
        self._side_streams: dict[tuple[torch.device, bool], Any] = {}
        self._param_storages: frozenset[int] = frozenset()
        self._forward = _Forward()
        self._depth = 0
        self._in_flight: deque[Flight] = deque()
        self._lock = threading.RLock()
        self._ref = weakref.ref(self)
        self._copies = _Copies()
        self._open: dict[tuple[torch.dtype, torch.device], weakref.ref[_Group]] = {}
        self._passes: dict[int, _Pass] = {}
        self._order: Order = ()
        self._held: deque[tuple[weakref.ref[_HostCopy], int]] = deque()
        self._held_bytes = 0
        self._kept: list[tuple[list[weakref.ref[_Kept]], int]] = []
        self._kept_bytes = 0
        self._keep_all = False
        self._on_plan = False
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
            if copy is None:
                exact = first == 0 and contiguous and span_bytes == total
                key = (ptr, version, total)
                span = (first, span_bytes, elem)
                copy, same = self._new_copy(t, forward, storage, key, whole, span, exact)
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

    def _new_copy(
        self,
        t: torch.Tensor,
        forward: _Forward,
        storage: torch.UntypedStorage,
        key: tuple[int, int, int],
        whole: bool,
        span: tuple[int, int, int],
        exact: bool,
    ) -> tuple[_HostCopy, bool]:
        """A host copy of ``t``'s storage (``key``: its address, version and bytes), whole
        or of ``span`` (its first element, its bytes, the element size), recorded in
        ``forward`` and moved, held or kept as the plan says (lock held); and whether ``t``
        is exactly its bytes (:attr:`_Offloaded.same`; ``exact``: ``t`` is its whole
        storage, contiguous from its start)."""
        ptr, version, total = key
        first, span_bytes, elem = span
        copy = _HostCopy(total if whole else span_bytes, 0 if whole else first * elem, t.device)
        copy.version = version
        ref = self._copies.add(copy)  # numbers it
        forward.record(copy)
        same = False
        if whole:
            if total % elem == 0:
                copy.dtype = t.dtype
                if exact:
                    copy.like = (t.dtype, t.shape)
                    same = True
            copy.source = weakref.ref(storage)
            forward.shared[(ptr, version)] = ref
        sizes = forward.sizes
        if not whole:  # the small-storage rule weighs the storage it keeps
            forward.spans[len(sizes)] = key
        sizes.append(copy.nbytes)  # this forward's copies, for the plan
        if self._measuring is not None:  # when it was saved, for the plan
            self._measuring.saved()
        planner = self._planner
        if planner.plan is None and planner.device_budget is None and not planner.goal:
            self._copy_out(t, copy, ref)  # a first forward with no budget: all move
        else:
            self._budgeted(copy, t, ref)
        return copy, same

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
