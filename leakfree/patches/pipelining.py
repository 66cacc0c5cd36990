"""torch.distributed.pipelining: each microbatch's received activation, sent output and
receive buffers live as long as that microbatch, and no longer.

What torch 2.12 - 2.14 keeps (docs/pipeline.md has the measured bytes):

* **the receive buffer is the stage input.** ``_retrieve_recv_activations`` hands the
  persistent buffer itself to the stage (``buffer.requires_grad_()``), every step. A tensor
  hook that user code registers on a stage input stays on the buffer and fires once more
  each step (pytorch #185331); whatever its closure holds is never freed. The seed's shape:
  a received tensor that outlives its microbatch;
* **outputs stay after they are sent.** Each microbatch's output waits in ``fwd_cache``
  until that microbatch's backward, although once its send has completed backward needs the
  graph, not the values (Megatron's ``deallocate_output_tensor``);
* **one receive buffer per microbatch** (activations and gradients), allocated at setup
  and held for the run, through every optimizer step (pytorch #136380);
* **after ``step()``** the last stage's ``output_chunks`` and the caches stay until the
  next ``step()`` begins.

Four records, one per behaviour, each off with ``patch_all(torch_pipelining_<name>=False)``
(all four: ``patch_all(torch_pipelining=False)``), built from :mod:`leakfree.pipeline`'s
primitives so that each mechanism exists once:

``stage_inputs``
    ``_PipelineStageBase._retrieve_recv_activations`` returns, per microbatch, a fresh
    non-leaf alias of the received data (:func:`~leakfree.pipeline.as_nonleaf`) whose
    gradient goes to a :class:`~leakfree.pipeline.GradSlot`; ``stage_backward`` (the stage
    module's name for it) reads the input gradients from the slots instead of ``.grad``.
    Hooks, ``.grad`` and anything attached to a stage input die with its microbatch.
``sent_outputs``
    ``get_fwd_send_ops`` notes which output each send carries; the schedules' own
    ``_batch_p2p`` / ``_wait_batch_p2p`` tell which ``Work`` carries it and when it has
    completed (a wait, or ``is_completed()`` polled at the stage's next send: NCCL answers
    it, gloo only after a wait). Then :func:`~leakfree.pipeline.release.release_output`'s
    mechanism frees the output's storage (keeping its shape, stride 0, so torch's own
    ``backward(outputs, grads)`` still runs from the graph) and the send tensor's, which the
    schedule's finished ``Work`` may still hold. Never waits, never blocks.
``recv_buffers``
    ``get_fwd_recv_ops`` / ``get_bwd_recv_ops`` allocate the microbatch's receive buffers
    just in time (the device's caching allocator makes that cheap); the stage drops its
    reference once the forward has made the activation from it, or the backward has read
    the gradient. The setup-time buffers go at their first use. None are held between
    steps.
``step_state``
    ``PipelineScheduleSingle.step`` / ``PipelineScheduleMulti.step`` end (also when they
    raise: in ``finally``, never masking the error) with the stage's public
    ``clear_runtime_states()`` and leakfree's own bookkeeping dropped: after ``step()``
    returns, nothing of the step is held but what the caller receives.

Left untouched, and said once with a :class:`leakfree.PatchWarning`: receives with DTensor
metadata and tensor subclasses (their reconstruction is torch's), and outputs that are
views, leaves or saved by their own node (nothing to free). Gated on the code found, and
on the releases each repair was measured on (:data:`RELEASES`, :data:`SEND_RELEASES`);
elsewhere only with ``patch_all(torch_pipelining="always")``, where the code gates alone
decide.
"""

from __future__ import annotations

import functools
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from leakfree.errors import PatchWarning
from leakfree.patches._code import code_facts
from leakfree.patches._originals import Changes
from leakfree.patches._registry import REGISTRY, Patch, Reason, Skip
from leakfree.pipeline.release import swap_out
from leakfree.pipeline.slots import GradSlot, as_nonleaf

__all__ = ["DISTRIBUTIONS", "PATCHES", "SendLedger"]

STAGE = "torch.distributed.pipelining.stage"
SCHEDULES = "torch.distributed.pipelining.schedules"
DISTRIBUTIONS = ("torch",)
#: The releases each repair was measured on (benchmarks/pipeline_versions.py, docs/pipeline.md:
#: 2.8.0, 2.10.0 - 2.14.1; 2.9.1 crashes on gloo before its first step, patched or not).
#: The stage-input and receive-buffer repairs need the receive metadata of 2.12 and later;
#: the sent-output and step-state repairs run on 2.8 too. Elsewhere only with
#: ``patch_all(torch_pipelining="always")``, where the code gates alone decide.
RELEASES = ">=2.12"
SEND_RELEASES = ">=2.8,!=2.9.*"
#: Where a stage input made by ``stage_inputs`` keeps its slot (the input's own
#: ``__dict__``: the slot dies with the input, and holds nothing of it).
SLOT_ATTR = "_leakfree_grad_slot"
BASE = "_PipelineStageBase"

#: Set True (through the table of originals, so ``unpatch_all()`` resets it) while the
#: ``recv_buffers`` record is applied: the step's end may then drop buffers too.
_JUST_IN_TIME = False


# --- guest rules ------------------------------------------------------------------------------

_warned: set[str] = set()


def _say_once(what: str) -> None:
    """One :class:`~leakfree.PatchWarning` per distinct message, for the process's life."""
    if what not in _warned:
        _warned.add(what)
        warnings.warn(f"leakfree torch_pipelining: {what}", PatchWarning, stacklevel=4)


#: the integration these patches belong to (``patch_all(torch_pipelining=False)``)
INTEGRATION = "torch_pipelining"


def _untouched(what: str) -> None:
    """Say once per kind that something was left as torch made it."""
    _say_once(f"left untouched: {what}")


def _guest(fn: Callable[..., None]) -> Callable[..., None]:
    """Bookkeeping that must never break the host: an unexpected error becomes one
    warning (``patch_all(strict=True)``: raised), and torch's step goes on as torch's."""

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as e:
            if REGISTRY.is_strict(INTEGRATION):
                raise
            _say_once(
                f"{fn.__name__} failed ({type(e).__name__}: {e}); "
                "the step went on, that repair skipped"
            )

    return guarded


def _is_plain_recv(module: types.ModuleType, info: Any, *, buffer_may_be_none: bool) -> bool:
    """A receive from another rank of a plain tensor: what the repair knows how to handle."""
    if getattr(info, "is_root_arg", True):
        return False
    meta = getattr(info, "tensor_meta", None)
    dtensor_meta = getattr(module, "_DTensorMeta", None)
    if meta is None or (dtensor_meta is not None and isinstance(meta, dtensor_meta)):
        return False
    buffer = info.buffer
    return type(buffer) is torch.Tensor or (buffer is None and buffer_may_be_none)


# --- stage_inputs -----------------------------------------------------------------------------


def _retrieve_recv_activations(original: Callable[..., Any], module: types.ModuleType) -> Any:
    @functools.wraps(original)
    def _retrieve_recv_activations(self: Any, fwd_chunk_id: int) -> tuple[torch.Tensor, ...]:
        infos = self.args_recv_info[fwd_chunk_id]
        if not all(_is_plain_recv(module, i, buffer_may_be_none=False) for i in infos):
            _untouched("stage inputs with DTensor metadata, or tensor subclasses")
            return original(self, fwd_chunk_id)  # type: ignore[no-any-return]
        wants_grad = self.has_backward and torch.is_grad_enabled()
        activations = []
        for info in infos:
            # Never the buffer itself: an alias made for this microbatch (a buffer a past
            # step made a leaf of is detached first).
            data = info.buffer.detach()
            if wants_grad and info.tensor_meta.requires_grad:
                slot = GradSlot(accumulate=True)
                data = as_nonleaf(data, slot)
                data.__dict__[SLOT_ATTR] = slot
            activations.append(data)
        return tuple(activations)

    return _retrieve_recv_activations


def _slot_of(value: Any) -> GradSlot | None:
    if isinstance(value, torch.Tensor):
        slot = value.__dict__.get(SLOT_ATTR)
        return slot if isinstance(slot, GradSlot) else None
    return None


def _input_grad(slot: GradSlot, value: torch.Tensor) -> torch.Tensor | None:
    """What ``value.grad`` would have been for a leaf: the slot's gradient, laid out as
    autograd's accumulation lays out a leaf's (the input's strides: a send needs a dense
    tensor, and an expanded gradient is not one)."""
    if not slot.ready:
        return None  # no gradient reached this input; torch sends zeros, as for a leaf
    grad = slot.take()
    if grad.stride() != value.stride():
        dense = torch.empty_strided(
            value.shape, value.stride(), dtype=grad.dtype, device=grad.device
        )
        grad = dense.copy_(grad)
    return grad


def _stage_backward(original: Callable[..., Any]) -> Any:
    @functools.wraps(original)
    def stage_backward(
        stage_output: Any, output_grads: Any, input_values: Any, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor | None, ...]:
        slots = [_slot_of(v) for v in input_values]
        if all(s is None for s in slots):
            return original(stage_output, output_grads, input_values, *args, **kwargs)  # type: ignore[no-any-return]
        # torch reads (and clears) .grad of each input; ours have none: their gradients are
        # in their slots once the backward has run through them.
        shown = [v if s is None else None for v, s in zip(input_values, slots)]
        grads = original(stage_output, output_grads, shown, *args, **kwargs)
        return tuple(
            g if s is None else _input_grad(s, v) for g, s, v in zip(grads, slots, input_values)
        )

    return stage_backward


#: What torch's split backward (zero-bubble schedules) says when it reads ``inp.grad`` of an
#: input that is not a leaf: ours never are, and their ``.grad`` is dropped right after.
_NONLEAF_GRAD_WARNING = "The .grad attribute of a Tensor that is not a leaf Tensor"


def _stage_backward_input(original: Callable[..., Any]) -> Any:
    @functools.wraps(original)
    def stage_backward_input(
        stage_outputs_or_loss: Any, output_grads: Any, input_values: Any, *args: Any, **kwargs: Any
    ) -> Any:
        ours = [v for v in input_values if _slot_of(v) is not None]
        if not ours:
            return original(stage_outputs_or_loss, output_grads, input_values, *args, **kwargs)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NONLEAF_GRAD_WARNING, category=UserWarning)
            result = original(stage_outputs_or_loss, output_grads, input_values, *args, **kwargs)
        for value in ours:  # torch returns the gradients; the copy it set on .grad can go
            value.grad = None
        return result

    return stage_backward_input


def _check_stage_inputs(target: Any, module: types.ModuleType, option: Any = True) -> Skip | None:
    retrieve = _method(target, "_retrieve_recv_activations")
    backward = module.__dict__.get("stage_backward")
    if retrieve is None or not isinstance(backward, types.FunctionType):
        return Skip(
            Reason.TARGET_NOT_FOUND,
            f"{STAGE}: no {BASE}._retrieve_recv_activations or stage_backward function",
        )
    names, _ = code_facts(retrieve)
    if "requires_grad_" not in names:
        # The fix proposed upstream (pytorch #185355) hands a clone or an alias instead.
        return Skip(
            Reason.ALREADY_FIXED if {"clone", "detach"} & names else Reason.NOT_PRESENT,
            "_retrieve_recv_activations does not make the receive buffer a leaf in place",
        )
    if "grad" not in code_facts(backward)[0]:
        return Skip(Reason.TARGET_NOT_FOUND, "stage_backward does not read the inputs' .grad")
    return None


def _apply_stage_inputs(
    target: Any, module: types.ModuleType, option: Any, changes: Changes
) -> None:
    original = target.__dict__["_retrieve_recv_activations"]
    changes.setattr(
        target, "_retrieve_recv_activations", _retrieve_recv_activations(original, module)
    )
    changes.setattr(module, "stage_backward", _stage_backward(module.__dict__["stage_backward"]))
    split = module.__dict__.get("stage_backward_input")
    if isinstance(split, types.FunctionType):
        changes.setattr(module, "stage_backward_input", _stage_backward_input(split))


# --- recv_buffers -----------------------------------------------------------------------------


def _allocate(
    stage: Any, module: types.ModuleType, infos: Iterable[Any], *, zeros: bool = False
) -> None:
    for info in infos:
        if _is_plain_recv(module, info, buffer_may_be_none=True):
            if zeros and info.buffer is not None:
                continue
            buffer = module._make_tensor_from_meta(info.tensor_meta, stage.device)
            info.buffer = buffer.zero_() if zeros else buffer


def _drop(module: types.ModuleType, infos: Iterable[Any]) -> None:
    for info in infos:
        if _is_plain_recv(module, info, buffer_may_be_none=True):
            info.buffer = None


def _recv_buffers(
    originals: dict[str, Callable[..., Any]], module: types.ModuleType
) -> dict[str, Any]:
    get_fwd, get_bwd = originals["get_fwd_recv_ops"], originals["get_bwd_recv_ops"]
    forward, backward = originals["forward_one_chunk"], originals["backward_one_chunk"]

    def get_fwd_recv_ops(self: Any, fwd_chunk_id: int) -> Any:
        _allocate(self, module, self.args_recv_info.get(fwd_chunk_id, ()))
        return get_fwd(self, fwd_chunk_id)

    def get_bwd_recv_ops(self: Any, bwd_chunk_id: int) -> Any:
        if self.has_backward and not self.is_last:
            _allocate(self, module, self.grad_recv_info.get(bwd_chunk_id, ()))
        return get_bwd(self, bwd_chunk_id)

    def forward_one_chunk(self: Any, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        try:
            return forward(self, fwd_chunk_id, *args, **kwargs)
        finally:  # the activation (and the graph) hold the data now, not the stage
            _drop(module, self.args_recv_info.get(fwd_chunk_id, ()))

    def backward_one_chunk(self: Any, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        # A gradient passed by a same-rank stage as None (V-schedules) is zeros, as torch
        # zeroes its persistent buffer for it.
        _allocate(self, module, self.grad_recv_info.get(bwd_chunk_id, ()), zeros=True)
        try:
            return backward(self, bwd_chunk_id, *args, **kwargs)
        finally:
            _drop(module, self.grad_recv_info.get(bwd_chunk_id, ()))

    return {
        "get_fwd_recv_ops": functools.wraps(get_fwd)(get_fwd_recv_ops),
        "get_bwd_recv_ops": functools.wraps(get_bwd)(get_bwd_recv_ops),
        "forward_one_chunk": functools.wraps(forward)(forward_one_chunk),
        "backward_one_chunk": functools.wraps(backward)(backward_one_chunk),
    }


_RECV_METHODS = ("get_fwd_recv_ops", "get_bwd_recv_ops", "forward_one_chunk", "backward_one_chunk")


def _check_recv_buffers(target: Any, module: types.ModuleType, option: Any = True) -> Skip | None:
    missing = [m for m in (*_RECV_METHODS, "_get_recv_ops") if _method(target, m) is None]
    if missing or not callable(module.__dict__.get("_make_tensor_from_meta")):
        return Skip(
            Reason.TARGET_NOT_FOUND,
            f"{STAGE}: {', '.join(missing) or '_make_tensor_from_meta'} not found",
        )
    names = (
        code_facts(_method(target, "get_fwd_recv_ops"))[0]
        | code_facts(_method(target, "_get_recv_ops"))[0]
    )
    if "_make_tensor_from_meta" in names:  # pytorch #196463: allocated just in time
        return Skip(Reason.ALREADY_FIXED, "receive buffers are allocated when received")
    init = _method(module.__dict__.get("_RecvInfo"), "__init__")
    if init is None or "tensor_meta" not in code_facts(init)[1]:
        # A receive that carries no metadata has nothing to allocate a buffer from
        # (measured on torch 2.8: the repair would allocate nothing, and drop nothing).
        return Skip(Reason.NOT_PRESENT, "_RecvInfo keeps no tensor_meta to allocate from")
    return None


def _apply_recv_buffers(
    target: Any, module: types.ModuleType, option: Any, changes: Changes
) -> None:
    wrapped = _recv_buffers({m: target.__dict__[m] for m in _RECV_METHODS}, module)
    for name, fn in wrapped.items():
        changes.setattr(target, name, fn)
    changes.setattr(sys.modules[__name__], "_JUST_IN_TIME", True)


# --- sent_outputs -----------------------------------------------------------------------------


class _Sent:
    """One sent output: weak references only, so the ledger never keeps what torch let go."""

    __slots__ = ("out", "posted", "sends", "stage", "waiting")

    def __init__(self, out: torch.Tensor, stage: Any) -> None:
        self.out = weakref.ref(out)
        self.stage = weakref.ref(stage)
        self.sends: list[weakref.ref[torch.Tensor]] = []
        self.posted = 0  # sends handed to a Work
        self.waiting: set[int] = set()  # ids of the Works not known complete


class SendLedger:
    """Which sent output rides on which ``Work``, until the Work is known complete.

    Kept: weak references to the outputs, their send tensors and the Works (never the
    tensors' memory), from ``get_fwd_send_ops`` until the release or the step's end.
    ``released`` / ``released_bytes`` count what was freed (plain numbers). Used from the
    thread that runs the schedules (as torch's schedules are): not locked.
    """

    def __init__(self) -> None:
        self._by_tensor: dict[int, tuple[weakref.ref[torch.Tensor], _Sent]] = {}
        self._by_work: dict[int, tuple[weakref.ref[Any], list[_Sent]]] = {}
        self.released = 0
        self.released_bytes = 0

    def note(self, stage: Any, outputs: Iterable[Any], ops: Iterable[Any]) -> None:
        """The sends ``ops`` of one microbatch whose ``outputs`` the stage produced."""
        by_storage: dict[int, torch.Tensor] = {}
        for out in outputs:
            if (
                type(out) is torch.Tensor
                and out.requires_grad
                and not out.is_leaf
                and out._base is None
                and out.numel() > 0
            ):
                by_storage[out.untyped_storage().data_ptr()] = out
        records: dict[int, _Sent] = {}
        for op in ops:
            tensor = op.tensor
            out = by_storage.get(tensor.untyped_storage().data_ptr())
            if out is None or tensor.shape != out.shape:
                continue
            record = records.setdefault(id(out), _Sent(out, stage))
            record.sends.append(weakref.ref(tensor))
            self._by_tensor[id(tensor)] = (weakref.ref(tensor), record)

    def posted(self, ops: list[Any], works: list[Any]) -> None:
        """``_batch_p2p(ops)`` returned ``works``: one per op, or (coalesced) for all."""
        if not self._by_tensor:
            return
        paired = len(works) == len(ops)
        for i, op in enumerate(ops):
            entry = self._by_tensor.pop(id(op.tensor), None)
            if entry is None or entry[0]() is not op.tensor:
                continue
            record = entry[1]
            record.posted += 1
            for work in [works[i]] if paired else works:
                record.waiting.add(id(work))
                _ref, records = self._by_work.setdefault(id(work), (weakref.ref(work), []))
                records.append(record)

    def completed(self, works: Iterable[Any]) -> None:
        """``works`` are complete (waited): release every output whose sends all are."""
        for work in works:
            entry = self._by_work.get(id(work))
            if entry is None or entry[0]() is not work:
                continue
            del self._by_work[id(work)]
            for record in entry[1]:
                record.waiting.discard(id(work))
                if not record.waiting and record.posted == len(record.sends):
                    self._release(record)

    def poll(self) -> None:
        """Release what a Work reports complete without a wait (NCCL; gloo never does)."""
        done = []
        for ref, _ in list(self._by_work.values()):
            work = ref()
            if work is not None and work.is_completed():
                done.append(work)
        if done:
            self.completed(done)

    def _release(self, record: _Sent) -> None:
        out = record.out()
        sends = [s() for s in record.sends]
        if out is None or any(s is None for s in sends):
            return  # torch already let go of it
        nbytes = out.untyped_storage().nbytes()
        if swap_out(out, [s for s in sends if s is not None], keep_shape=True):
            self.released += 1
            self.released_bytes += nbytes

    def forget(self, stages: Iterable[Any]) -> None:
        """The step of ``stages`` is over: drop what is still noted for them."""
        ids = {id(s) for s in stages}

        def kept(record: _Sent) -> bool:
            return id(record.stage()) not in ids

        self._by_tensor = {k: v for k, v in self._by_tensor.items() if kept(v[1])}
        by_work = {}
        for key, (ref, records) in self._by_work.items():
            left = [r for r in records if kept(r)]
            if left and ref() is not None:
                by_work[key] = (ref, left)
        self._by_work = by_work


#: The one ledger of this process (the schedules' helpers are module functions).
LEDGER = SendLedger()


def _sent_outputs(target: Any, schedules: types.ModuleType) -> dict[tuple[Any, str], Any]:
    get_fwd_send, get_bwd_send = (
        target.__dict__["get_fwd_send_ops"],
        target.__dict__["get_bwd_send_ops"],
    )
    batch, wait = schedules.__dict__["_batch_p2p"], schedules.__dict__["_wait_batch_p2p"]

    note = _guest(lambda stage, mb, ops: LEDGER.note(stage, stage.fwd_cache[mb][0], ops))
    posted = _guest(LEDGER.posted)
    completed = _guest(LEDGER.completed)
    poll = _guest(LEDGER.poll)

    @functools.wraps(get_fwd_send)
    def get_fwd_send_ops(self: Any, fwd_chunk_id: int) -> Any:
        ops = get_fwd_send(self, fwd_chunk_id)
        poll()
        note(self, fwd_chunk_id, ops)
        return ops

    @functools.wraps(get_bwd_send)
    def get_bwd_send_ops(self: Any, bwd_chunk_id: int) -> Any:
        poll()
        return get_bwd_send(self, bwd_chunk_id)

    @functools.wraps(batch)
    def _batch_p2p(p2p_ops: Any, *args: Any, **kwargs: Any) -> Any:
        works = batch(p2p_ops, *args, **kwargs)
        posted(list(p2p_ops), list(works))
        return works

    @functools.wraps(wait)
    def _wait_batch_p2p(work: Any, *args: Any, **kwargs: Any) -> Any:
        result = wait(work, *args, **kwargs)
        completed(list(work))
        return result

    return {
        (target, "get_fwd_send_ops"): get_fwd_send_ops,
        (target, "get_bwd_send_ops"): get_bwd_send_ops,
        (schedules, "_batch_p2p"): _batch_p2p,
        (schedules, "_wait_batch_p2p"): _wait_batch_p2p,
    }


def _check_sent_outputs(target: Any, module: types.ModuleType, option: Any = True) -> Skip | None:
    base = getattr(sys.modules.get(STAGE), BASE, None)
    missing = [
        name
        for owner, name in (
            (base, "get_fwd_send_ops"),
            (base, "get_bwd_send_ops"),
            (module, "_batch_p2p"),
            (module, "_wait_batch_p2p"),
        )
        if owner is None or not callable(vars(owner).get(name))
    ]
    if missing:
        return Skip(Reason.TARGET_NOT_FOUND, f"not found: {', '.join(missing)}")
    if "fwd_cache" not in code_facts(_method(base, "get_fwd_send_ops"))[0]:
        return Skip(Reason.TARGET_NOT_FOUND, "get_fwd_send_ops does not read fwd_cache")
    if "resize_" in code_facts(_method(base, "backward_one_chunk"))[0]:
        # pytorch #193903 frees sent outputs itself (resize_ of their storage)
        return Skip(Reason.ALREADY_FIXED, "the stage frees sent outputs itself")
    return None


def _apply_sent_outputs(
    target: Any, module: types.ModuleType, option: Any, changes: Changes
) -> None:
    base = getattr(sys.modules[STAGE], BASE)
    for (owner, name), fn in _sent_outputs(base, module).items():
        changes.setattr(owner, name, fn)


# --- step_state -------------------------------------------------------------------------------


def _stages_of(schedule: Any) -> list[Any]:
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        stage = getattr(schedule, "_stage", None)
        stages = [] if stage is None else [stage]
    return list(stages)


def _end_step(schedule: Any) -> None:
    stages = _stages_of(schedule)
    module = sys.modules[STAGE]
    for stage in stages:
        stage.clear_runtime_states()  # public: what the next step() would do first
        if _JUST_IN_TIME:  # a step that failed midway may have left buffers
            for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
                _drop(module, infos)
    LEDGER.forget(stages)


def _step(original: Callable[..., Any]) -> Any:
    end = _guest(_end_step)

    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            end(self)  # guarded: never replaces the step's own error

    return step


_SCHEDULE_CLASSES = ("PipelineScheduleSingle", "PipelineScheduleMulti")


def _check_step_state(target: Any, module: types.ModuleType, option: Any = True) -> Skip | None:
    missing = [
        name
        for name in _SCHEDULE_CLASSES
        if not callable(vars(getattr(module, name, object)).get("step"))
    ]
    base = getattr(sys.modules.get(STAGE), BASE, None)
    if missing or base is None or _method(base, "clear_runtime_states") is None:
        return Skip(
            Reason.TARGET_NOT_FOUND,
            f"not found: {', '.join(f'{n}.step' for n in missing) or 'clear_runtime_states'}",
        )
    return None


def _apply_step_state(target: Any, module: types.ModuleType, option: Any, changes: Changes) -> None:
    for name in _SCHEDULE_CLASSES:
        cls = getattr(module, name)
        changes.setattr(cls, "step", _step(cls.__dict__["step"]))


# --- the records ------------------------------------------------------------------------------


def _method(cls: Any, name: str) -> Any:
    fn = vars(cls).get(name) if isinstance(cls, type) else None
    return fn if isinstance(fn, types.FunctionType) else None


def _patch(
    name: str,
    module: str,
    target: str,
    check: Any,
    apply: Any,
    description: str,
    releases: str = RELEASES,
) -> Patch:
    return Patch(
        name=f"torch_pipelining.{name}",
        integration=INTEGRATION,
        distributions=DISTRIBUTIONS,
        # Where the stage lives since pipelining became public; the code gates decide
        # there. By default only the releases it was measured on (RELEASES) are touched.
        modules=((">=2.4", module),),
        target=target,
        affected=releases,
        fixed_in="no release",
        check=check,
        apply=apply,
        description=description,
        outside=f"the repair is measured on torch {releases}; "
        "patch_all(torch_pipelining='always') lets the code gates decide",
    )


PATCHES: tuple[Patch, ...] = (
    _patch(
        "stage_inputs",
        STAGE,
        BASE,
        _check_stage_inputs,
        _apply_stage_inputs,
        "each microbatch's stage input is a fresh non-leaf alias; hooks and grads die with it",
    ),
    _patch(
        "sent_outputs",
        SCHEDULES,
        "_batch_p2p",
        _check_sent_outputs,
        _apply_sent_outputs,
        "a sent output's storage is freed once its send completed; backward runs from the graph",
        SEND_RELEASES,
    ),
    _patch(
        "recv_buffers",
        STAGE,
        BASE,
        _check_recv_buffers,
        _apply_recv_buffers,
        "receive buffers allocated when received, dropped when used; none held between steps",
    ),
    _patch(
        "step_state",
        SCHEDULES,
        "PipelineScheduleSingle",
        _check_step_state,
        _apply_step_state,
        "step() ends with the stage's runtime state cleared: only what the caller receives stays",
        SEND_RELEASES,
    ),
)
