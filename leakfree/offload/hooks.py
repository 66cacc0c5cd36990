"""The context managers: :class:`OffloadActivations` and :class:`NoOffload`.

:class:`OffloadActivations` is a front that holds one part per concern, each owning its
state: the copies and their streams (:class:`~leakfree.offload.transfers.Transfers`), what
stays on the device (:class:`~leakfree.offload.keeping.Keeper`), the plan
(:class:`~leakfree.offload.plan.Planner`, over the
:class:`~leakfree.offload.options.Options` and their mode), a goal's measured steps
(:class:`~leakfree.offload.measure.Measurer`) and backward's passes
(:class:`~leakfree.offload.backward.Backward`). The front has the hooks, the settings and
a forward's bounds; its pack hook returns a handle (:mod:`leakfree.offload.handles`) that
the graph owns. :class:`NoOffload` keeps saved tensors where they are.
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast, overload

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

import leakfree._args as _args
from leakfree._device import accelerator, device_index, device_module
from leakfree.offload.backward import Backward, graph_task
from leakfree.offload.capture import Capture
from leakfree.offload.handles import _Forward, _HostCopy, _Kept, _Offloaded, _span
from leakfree.offload.keeping import Keeper
from leakfree.offload.measurer import Measurer
from leakfree.offload.options import AUTO, Mode, Options
from leakfree.offload.plan import OffloadPlan, Planner
from leakfree.offload.pool import HostBlockPool, HostBudget
from leakfree.offload.stats import OffloadStats
from leakfree.offload.transfers import Transfers

__all__ = ["NoOffload", "OffloadActivations"]


def _check_min_offload_size(name: str | None, value: object) -> None:
    """The one check of ``min_offload_size``, at construction and on assignment."""
    call = "OffloadActivations" if name else "OffloadActivations.min_offload_size"
    _args.count(call, name, value, 0, unit="bytes")


def _target(
    use_pin_memory: object,
    use_streams: object,
    force_host_copy: object,
    min_offload_size: object,
    prefetch_bytes: object,
    pin_memory_budget: object,
    device: object,
) -> torch.device | None:
    """The arguments of :class:`OffloadActivations` that are not :class:`Options`, checked
    before any state exists; the device offloaded from (None: nothing to offload from)."""
    call = "OffloadActivations"
    for name, value in (
        ("use_pin_memory", use_pin_memory),
        ("use_streams", use_streams),
        ("force_host_copy", force_host_copy),
    ):
        _args.flag(call, name, value)
    _args.count(call, "prefetch_bytes", prefetch_bytes, 0, none=True, unit="bytes; 0: none")
    if not isinstance(pin_memory_budget, HostBudget):
        _args.count(call, "pin_memory_budget", pin_memory_budget, 0, none=True, unit="bytes")
    _check_min_offload_size("min_offload_size", min_offload_size)
    target = _args.device(call, "device", device) if device is not None else accelerator()
    if target is None and force_host_copy:
        target = torch.device("cpu")
    if target is not None and target.type == "cpu" and not force_host_copy:
        raise ValueError(
            "OffloadActivations(device='cpu'): offloading CPU tensors to CPU only makes "
            "sense to exercise the path; pass force_host_copy=True for that"
        )
    return target


def _indexed(device: torch.device, index: int | None) -> torch.device:
    return device if index is None else torch.device(device.type, index)


def _storages_of(model: nn.Module) -> frozenset[int]:
    """The addresses of ``model``'s parameters' and buffers' storages."""
    storages = set()
    for t in [*model.parameters(), *model.buffers()]:
        local = getattr(t, "_local_tensor", t)  # DTensor shards
        try:
            ptr = local.untyped_storage().data_ptr()
        except RuntimeError:
            continue
        if ptr:
            storages.add(ptr)
    return frozenset(storages)


def _pack_hook(manager_ref: weakref.ref[OffloadActivations]) -> Callable[[torch.Tensor], Any]:
    # Module-level closures over a weak reference: hooks bound to the instance would make
    # every OffloadActivations a reference cycle (and its pinned pool gc-only).
    def pack(t: torch.Tensor) -> Any:
        manager = manager_ref()
        return _Kept(t) if manager is None else manager._pack(t)

    return pack


#: ``packed.unpack()``: a C-level call, no Python frame per saved tensor
_unpack_hook: Callable[[Any], torch.Tensor] = operator.methodcaller("unpack")


T = TypeVar("T")


class _Setting(Generic[T]):
    """A setting of :class:`OffloadActivations` that decides what stays on the device: read
    from its planner's :class:`~leakfree.offload.options.Options`, set through the
    manager's ``_set`` (checked with the others, refused before anything changes; the
    next forward then plans, or is measured, again)."""

    def __init__(self, read: Callable[[Options], T], doc: str) -> None:
        self._read = read
        self.__doc__ = doc
        self._name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, manager: None, owner: type) -> _Setting[T]: ...

    @overload
    def __get__(self, manager: OffloadActivations, owner: type) -> T: ...

    def __get__(self, manager: OffloadActivations | None, owner: type) -> T | _Setting[T]:
        if manager is None:
            return self
        return self._read(manager._planner.options)

    def __set__(self, manager: OffloadActivations, value: object) -> None:
        manager._set(self._name, value)


class OffloadActivations(saved_tensors_hooks):
    """Offload activations saved for backward to host memory; the graph owns every payload.

    Args (the first four as TRL's ``OffloadActivations``):
        use_pin_memory: copy into pinned host memory (from a reusable pool) so copies can be
            asynchronous.
        use_streams: on an accelerator, copy on two side streams (one each way, so the
            directions run at once) that overlap with compute.
        min_offload_size: tensors smaller than this many bytes stay where they are.
        max_fwd_stash_size: how many copies out may be in flight holding their device
            tensors, as TRL's (default None: 5; a budget only).
        prefetch_bytes: how many bytes backward may have brought back ahead of their use
            (with ``use_streams``; at least one group), in the order the previous backward
            of the same shape used (the first copies on demand). Default (None): twice the
            largest group the pass brings back. 0 turns prefetch off. (A goal's plan also
            brings back the earliest groups as backward begins, besides this.)
        batch_bytes: copies out smaller than this share a host block and one transfer each
            way with the ones of their dtype saved beside them (default 256 KiB; 0: each
            alone).
        keep_small: the automatic budget keeps the smallest saved storages on the device,
            up to 1/64 of what a forward saves (default None: True; False: every storage
            of at least ``min_offload_size`` moves, as TRL's).
        device_budget: bytes of saved activations to keep on the device: ``"auto"`` (the
            default; None means the same) or a number (0: move every one).
        max_overhead: a time goal: the step time offloading may add, a fraction of the
            step's compute (0.05: 5%), planned from a measured step.
        device_limit: a memory goal: bytes the step may hold on the device, planned from a
            measured step and checked by the next.

        These six decide what stays on the device, and make the manager's :attr:`mode`:
        :class:`~leakfree.offload.options.Options` says in full what each does and which
        go together (a budget and a goal do not; ``keep_small`` only with the automatic
        budget, ``max_fwd_stash_size`` only with a budget). All are settable: the
        next forward then plans, or is measured, again, as a first forward is.
        device: the device to offload from; by default the current accelerator. Tensors on
            other device types stay put.
        force_host_copy: without an accelerator, offload CPU tensors to separate host
            buffers, so the whole path runs and is tested on the CPU (restored tensors view
            those buffers). Without it, on such a machine, the context is a cheap no-op.
        pin_memory_budget: bytes of pinned host memory this manager's pool may hold (as
            PyTorch's pinned allocator rounds them), a budget of its own; or a
            ``HostBudget`` (``leakfree.offload.pool``), shared with the managers given the
            same one (``HostBudget()``: of the default size). Beyond it copies use pageable
            memory. Default (None): the budget every such manager of the process shares
            (``PROCESS_BUDGET``), a quarter of the node's memory divided among the
            processes on the node (``LOCAL_WORLD_SIZE``).

    Copies out travel in groups (``batch_bytes``), sent to one host block when full, when
    backward needs them, or at ``__exit__``. In one backward pass each group comes back
    once: kept until the last handle of its copies is unpacked, or the pass ends.

    Parameters, views of parameters, what ``update_model_params`` registered (matched by
    storage address: call it again after moving the model), tensor subclasses, non-strided
    layouts and tensors with lazy conj/neg bits are never offloaded. Several views of one
    storage are copied once and restored as views of one storage again. Restored tensors
    have the original shape and strides (and storage offset, for whole-storage copies), so
    gradients are bit-identical. In-place changes to a saved tensor are reported as PyTorch
    reports them while the tensor is still on the device (kept, or its group not sent).

    ``__exit__`` sends the open groups and lets go of the device tensors kept for copies
    in flight: backward may begin while they run. The hooks are popped in ``finally``.

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
        pin_memory_budget: int | HostBudget | None = None,
        prefetch_bytes: int | None = None,
        device_budget: int | str | None = AUTO,
        batch_bytes: int = 256 << 10,
        keep_small: bool | None = None,
        max_overhead: float | None = None,
        device_limit: int | None = None,
    ) -> None:
        target = _target(
            use_pin_memory, use_streams, force_host_copy, min_offload_size, prefetch_bytes,
            pin_memory_budget, device,
        )  # fmt: skip
        #: what a manager of another device (a lane, :meth:`_lane`) is made with
        self._arguments = {
            "use_pin_memory": use_pin_memory, "use_streams": use_streams,
            "force_host_copy": force_host_copy, "pin_memory_budget": pin_memory_budget,
            "prefetch_bytes": prefetch_bytes,
        }  # fmt: skip
        options = Options.checked(
            "OffloadActivations",
            device_budget=device_budget,
            keep_small=keep_small,
            max_fwd_stash_size=max_fwd_stash_size,
            max_overhead=max_overhead,
            device_limit=device_limit,
            batch_bytes=batch_bytes,
        )
        self.device: torch.device | None = target
        accelerated = target is not None and target.type != "cpu"
        self.use_pin_memory = use_pin_memory and accelerated
        self.min_offload_size = min_offload_size
        self.stats = OffloadStats()
        self.enabled = target is not None
        self._device_type = target.type if target is not None else None
        self._param_storages: frozenset[int] = frozenset()
        self._lock = threading.RLock()  # backward may unpack on several device threads
        self._ref = weakref.ref(self)
        self._depth = 0  # nested entries of the same manager
        # the parts, each owning its state; they are called under the lock
        self._planner = Planner(options)
        self._transfers = Transfers(
            target,
            device_module(target) if accelerated and target else None,
            use_streams=use_streams and accelerated,
            pool=HostBlockPool(pin_memory_budget, pin=self.use_pin_memory),
            stats=self.stats,
            window=self._planner.window,
        )
        self._keeper = Keeper(self._planner, self._transfers, self.stats)
        self._measurer = Measurer(self._planner, self._transfers, self.stats)
        self._backward = Backward(
            self._transfers, self._planner, self._measurer, self._lock, prefetch_bytes
        )
        self._forward = _Forward()  # what this forward saved, for dedup and the plan
        self._capture = Capture(self._transfers.module)  # graph capture, where it can be
        #: the managers of the other devices of this one's type, by index, made as a
        #: tensor is first saved there: each measures, plans and limits its own device
        self._lanes: dict[int, OffloadActivations] = {}
        self._index = device_index(target) if accelerated and target is not None else None
        super().__init__(_pack_hook(self._ref), _unpack_hook)

    # -- settings -------------------------------------------------------------------------

    @property
    def use_streams(self) -> bool:
        """Whether copies run on side streams (on an accelerator, when asked)."""
        return self._transfers.use_streams

    @property
    def pool(self) -> HostBlockPool:
        """The pool of host blocks copies go to (kept until trimmed, or the manager dies)."""
        return self._transfers.pool

    @property
    def min_offload_size(self) -> int:
        """Tensors smaller than this many bytes stay where they are (settable)."""
        return self._min_offload_size

    @min_offload_size.setter
    def min_offload_size(self, value: int) -> None:
        _check_min_offload_size(None, value)
        self._min_offload_size = value
        self._min_bytes = max(value, 1)  # what the pack hook compares, precomputed
        for lane in getattr(self, "_lanes", {}).values():
            lane.min_offload_size = value

    @property
    def prefetch_bytes(self) -> int | None:
        """Bytes backward may have brought back ahead of their use (see the class)."""
        return self._backward.prefetch_bytes

    @property
    def mode(self) -> Mode:
        """How this manager decides what stays on the device (:class:`Mode`)."""
        return self._planner.mode

    @property
    def batch_bytes(self) -> int:
        """Copies smaller than this share a host block and a transfer (see the class)."""
        return self._planner.options.batch_bytes

    max_fwd_stash_size: _Setting[int] = _Setting(
        lambda o: o.stash,
        "Copies out in flight that may hold their device tensors (the automatic budget's "
        "window; settable, as ``keep_small``).",
    )
    device_budget: _Setting[int | str] = _Setting(
        lambda o: AUTO if o.device_budget is None else o.device_budget,
        'Bytes of saved activations to keep on the device, or ``"auto"`` (settable: the '
        "next forward then plans again, as a first forward does).",
    )
    max_overhead: _Setting[float | None] = _Setting(
        lambda o: o.max_overhead,
        "The step time offloading may add, a fraction of the step's compute (settable: the "
        "next step is measured and planned again).",
    )
    device_limit: _Setting[int | None] = _Setting(
        lambda o: o.device_limit,
        "Bytes the step may hold on the device (settable: the next step is measured and "
        "planned again).",
    )
    keep_small: _Setting[bool] = _Setting(
        lambda o: o.keeps_small,
        "Whether the plan keeps the smallest saved storages on the device (settable: the "
        "next forward then plans again, as a first forward does).",
    )

    def _set(self, option: str, value: object) -> None:
        """Set ``option`` (checked with the others, refused before anything changes); a
        change makes the next forward plan, or be measured, again, as a first forward is."""
        options = self._planner.options.with_(option, value)
        for manager in (self, *self._lanes.values()):
            with manager._lock:
                if options != manager._planner.options:
                    manager._measurer.reset()
                manager._planner.set(options)

    @property
    def plan(self) -> OffloadPlan | None:
        """What stays on the device and what moves per forward, and what a goal's plan
        predicts (None before the first forward ends, or a goal's first step)."""
        return self._planner.report()

    def update_model_params(self, model: nn.Module) -> None:
        """Never offload ``model``'s parameters and buffers (matched by storage address).

        Addresses change when the model moves (``.to()``) or its storage is re-created:
        call it again then.
        """
        _args.module("OffloadActivations.update_model_params", "model", model)
        self._param_storages = _storages_of(model)
        for lane in self._lanes.values():
            lane._param_storages = self._param_storages

    @property
    def lanes(self) -> dict[torch.device, OffloadActivations]:
        """This manager and the managers it made for the other devices of its type
        (where tensors were saved), by device: each measures, plans and limits its own
        device (``lanes[device].plan``, ``lanes[device].stats``). A device's manager is
        made with this one's settings, and follows their changes."""
        lanes: dict[torch.device, OffloadActivations] = {}
        if self.device is not None:
            lanes[_indexed(self.device, self._index)] = self
        for index, lane in self._lanes.items():
            lanes[_indexed(cast(torch.device, lane.device), index)] = lane
        return lanes

    def _lane(self, device: torch.device) -> OffloadActivations:
        """The manager of ``device`` (made with this one's settings on first use); its
        forward begins with this one's."""
        lane = self._lanes.get(device_index(device))
        if lane is None:
            lane = OffloadActivations(
                **self._arguments,  # type: ignore[arg-type]
                min_offload_size=self.min_offload_size,
                device=device,
            )
            lane._planner.set(self._planner.options)
            lane._param_storages = self._param_storages
            self._lanes[device_index(device)] = lane
        if self._depth > 0 and lane._depth == 0:
            with lane._lock:
                lane._begin_forward()
                lane._depth = 1
        return lane

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
        if self._index is not None and t.device.index != self._index:
            return self._lane(t.device)._pack(t)  # another device: its own manager's
        if self._capture.active():
            self._capture.keeps()
            return _Kept(t)
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
        if forward.began != self._backward.began or forward.records > forward.mark:
            forward = self._next_forward()
        keeper = self._keeper
        if total < self._planner.small_below and keeper.small_stays(forward, (ptr, version, total)):
            return _Kept(t)  # too small to be worth moving: see Planner.from_forward
        if keeper.keep_all:  # the plan moves nothing: kept as it is, its bytes counted
            with self._lock:
                kept = keeper.keep(forward, t, (ptr, version, total))
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
            return _Offloaded(self._backward.ref, copy, t, offset, same)

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
        """A new host copy of ``t``'s storage, numbered and recorded in ``forward``
        (:meth:`_Forward.new_copy`), and placed by the keeper (lock held); and whether
        ``t`` is exactly its bytes."""
        copy, same = forward.new_copy(t, storage, key, whole, span, exact)
        ref = self._backward.copies.add(copy)  # numbers it
        if whole:
            forward.shared[key[:2]] = ref
        measuring = self._measurer.measuring
        if measuring is not None:  # when it was saved, for the plan
            measuring.saved()
        self._keeper.place(forward, copy, t, ref)
        if self._planner.relengthed:
            self._planner.relengthed = False
            self._measurer.relengthed()
        return copy, same

    # -- a forward's bounds -------------------------------------------------------------------

    def _begin_forward(self) -> None:
        """A forward begins (lock held): its record is fresh, and each part starts over."""
        self._forward = _Forward(self._backward.began)
        self._keeper.begin_forward()
        self._measurer.begin_forward()

    def _close_forward(self) -> None:
        """The forward is over (lock held): its open groups are sent (a group holds one
        forward's copies), the next forward's plan is made from it, unless it followed
        the plan (a goal's is made once the step is measured, at the end of its backward;
        a forward of other shapes makes the next one measured). Earlier forwards' handles
        keep their own copies."""
        self._transfers.send_open()
        forward = self._forward
        planner = self._planner
        sizes = forward.sizes
        split = planner.split
        # a forward that saved as many as the plan's follows it (by place: its lengths
        # may differ); one that saved more or fewer makes a new plan, or a measured step
        if sizes and (split is None or len(sizes) != len(split.sizes)):
            if planner.mode.goal:
                self._measurer.forward_ended(tuple(sizes))
            else:
                planner.from_forward(*forward.weighed())
        elif sizes and planner.outgrown(tuple(sizes)):
            self._measurer.outgrown()
        self._keeper.end_forward()
        self._forward = _Forward(self._backward.began)  # its record goes

    def _next_forward(self) -> _Forward:
        """The pack hook's record is due a look (one ``with`` around many steps): a
        backward pass began unpacking this manager's tensors, or the record has grown past
        its mark. A new forward begins with this save, unless the save is made by a
        backward pass (double backward, recomputation: it belongs to the graph it
        extends) or most of what the record holds is still alive."""
        with self._lock:
            forward = self._forward
            if forward.began != self._backward.began:
                if graph_task() >= 0:
                    return forward
            elif not forward.outlived():
                return forward
            self._close_forward()
            self._begin_forward()
            return self._forward

    def __enter__(self) -> OffloadActivations:  # type: ignore[override]
        self._capture.refuse_entry()
        with self._lock:
            if self._depth == 0:  # nested entries of the same instance share the forward
                self._begin_forward()
                for lane in self._lanes.values():
                    with lane._lock:
                        lane._begin_forward()
                        lane._depth = 1
            self._depth += 1
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            with self._lock:
                self._depth -= 1
                closing = self._depth == 0
                for manager in (self, *(self._lanes.values() if closing else ())):
                    with manager._lock:
                        if closing:
                            manager._depth = 0
                            manager._close_forward()
                        # The window's tensors go (those whose copies still run are
                        # recorded on the side stream): backward may begin while the
                        # copies out run.
                        manager._transfers.let_go()
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
