"""The torch.distributed.pipelining repair as a patch: applied, reported, reverted to the
exact originals, gated on the code it finds, a guest that never breaks the step; and one
process running torch's V-shaped schedules (two stages on one rank, passed locally).

The multi-process proofs (every schedule, 2 and 4 ranks) are in
tests/integration/test_pipelining_repair.py.
"""

from __future__ import annotations

import dataclasses
import types
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from packaging.version import Version

import leakfree
from leakfree.patches import Outcome, Reason, get_original, is_object_patched
from leakfree.patches import pipelining as pp
from leakfree.patches._registry import REGISTRY, installed_version, version_matches
from tests import _pipelining as P
from tests._dist import free_port

_torch = installed_version(("torch",))
pytestmark = pytest.mark.skipif(
    _torch is None or not version_matches(_torch, pp.RELEASES),
    reason=f"the repair is built for torch {pp.RELEASES}",
)

stage_mod = pytest.importorskip("torch.distributed.pipelining.stage")
schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
BASE = stage_mod._PipelineStageBase
NAMES = [p.name for p in pp.PATCHES]

#: every attribute the four records change: (owner, name)
CHANGED = [
    (BASE, "_retrieve_recv_activations"),
    (stage_mod, "stage_backward"),
    (stage_mod, "stage_backward_input"),
    (BASE, "get_fwd_recv_ops"),
    (BASE, "get_bwd_recv_ops"),
    (BASE, "forward_one_chunk"),
    (BASE, "backward_one_chunk"),
    (BASE, "get_fwd_send_ops"),
    (BASE, "get_bwd_send_ops"),
    (schedules, "_batch_p2p"),
    (schedules, "_wait_batch_p2p"),
    (schedules.PipelineScheduleSingle, "step"),
    (schedules.PipelineScheduleMulti, "step"),
    (pp, "_JUST_IN_TIME"),
]


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    leakfree.unpatch_all()
    pp._warned.clear()
    yield
    leakfree.unpatch_all()


@pytest.fixture
def group() -> Iterator[None]:
    """A one-rank gloo group: torch's V-shaped schedules put both stages on it."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_applied_reported_and_reverted_to_the_exact_originals() -> None:
    before = {(id(o), n): vars(o)[n] for o, n in CHANGED}
    report = leakfree.patch_all()
    for name in NAMES:
        assert report[name].outcome is Outcome.APPLIED, report[name]
    for owner, name in CHANGED:
        assert is_object_patched(owner, name), name
        assert vars(owner)[name] is not before[id(owner), name], name
        assert get_original(owner, name) is before[id(owner), name], name
    assert pp._JUST_IN_TIME is True
    report = leakfree.unpatch_all()
    for owner, name in CHANGED:
        assert vars(owner)[name] is before[id(owner), name], name
        assert not is_object_patched(owner, name)
    assert {report[n].outcome for n in NAMES} == {Outcome.REVERTED}


def test_opt_out_whole_or_one_repair() -> None:
    report = leakfree.patch_all(torch_pipelining=False)
    assert {(report[n].outcome, report[n].reason) for n in NAMES} == {
        (Outcome.OFF, Reason.DISABLED_BY_CALLER)
    }
    assert vars(BASE)["get_fwd_send_ops"] is get_original(BASE, "get_fwd_send_ops")
    report = leakfree.patch_all(torch_pipelining_sent_outputs=False)
    assert report["torch_pipelining.sent_outputs"].reason is Reason.DISABLED_BY_CALLER
    assert not is_object_patched(schedules, "_batch_p2p")
    assert report["torch_pipelining.stage_inputs"].outcome is Outcome.APPLIED
    with pytest.raises(ValueError, match="torch_pipelining_recv_buffers=3"):
        leakfree.patch_all(torch_pipelining_recv_buffers=3)


def test_only_the_releases_each_repair_was_measured_on_unless_asked() -> None:
    """benchmarks/pipeline_versions.py measured each repair: stage inputs and receive
    buffers on 2.12 - 2.14 (2.10 and 2.11 have no receive metadata), sent outputs and step
    state on 2.8 and 2.10 - 2.14 (2.9.1 crashes on gloo before a step, patched or not)."""
    measured = {
        "stage_inputs": ["2.12.1", "2.13.0+cpu", "2.14.1"],
        "recv_buffers": ["2.12.1", "2.13.0+cpu", "2.14.1"],
        "sent_outputs": ["2.8.0", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1"],
        "step_state": ["2.8.0", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1"],
    }
    for patch in pp.PATCHES:
        versions = measured[patch.name.split(".")[1]]
        for v in ("2.4.1", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.14.1"):
            assert version_matches(Version(v), patch.affected) == (v in versions), (patch, v)
            assert patch.module_for(Version(v)) in (pp.STAGE, pp.SCHEDULES)  # 'always' can
        assert "torch_pipelining='always'" in patch.why_outside()
    plan = REGISTRY.plan(REGISTRY.select({}))
    assert plan["torch_pipelining.stage_inputs"].outcome is Outcome.WOULD_APPLY
    chosen = REGISTRY.select({"torch_pipelining": "always"})
    assert {chosen[p.name] for p in pp.PATCHES} == {"always"}


def _module_with(cls: type, **functions: Any) -> types.ModuleType:
    module = types.ModuleType("fake_stage")
    module.__dict__.update(functions, Base=cls)
    return module


def test_code_gates() -> None:
    class Cloning:
        def _retrieve_recv_activations(self, i: int) -> Any:
            return self.args_recv_info[i][0].buffer.detach().clone()  # type: ignore[attr-defined]

    class Gone:
        pass

    module = _module_with(Cloning, stage_backward=stage_mod.stage_backward)
    skip = pp._check_stage_inputs(Cloning, module)
    assert skip is not None and skip.reason is Reason.ALREADY_FIXED
    skip = pp._check_stage_inputs(Gone, module)
    assert skip is not None and skip.reason is Reason.TARGET_NOT_FOUND
    assert pp._check_stage_inputs(BASE, stage_mod) is None

    class JustInTime(BASE):  # type: ignore[misc, valid-type]
        def get_fwd_recv_ops(self, fwd_chunk_id: int) -> Any:
            info = self.args_recv_info[fwd_chunk_id][0]
            info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)  # noqa: F821
            return self._get_recv_ops(self.args_recv_info[fwd_chunk_id])

    for name in pp._RECV_METHODS:
        if name != "get_fwd_recv_ops":
            setattr(JustInTime, name, vars(BASE)[name])
    JustInTime._get_recv_ops = vars(BASE)["_get_recv_ops"]
    module = _module_with(JustInTime, _make_tensor_from_meta=stage_mod._make_tensor_from_meta)
    skip = pp._check_recv_buffers(JustInTime, module)
    assert skip is not None and skip.reason is Reason.ALREADY_FIXED

    class OldRecvInfo:  # torch 2.8: a receive without metadata
        def __init__(self, input_name: str, source: int, buffer: torch.Tensor) -> None:
            self.input_name, self.source, self.buffer = input_name, source, buffer

    module = _module_with(
        BASE, _make_tensor_from_meta=stage_mod._make_tensor_from_meta, _RecvInfo=OldRecvInfo
    )
    skip = pp._check_recv_buffers(BASE, module)
    assert skip is not None and skip.reason is Reason.NOT_PRESENT
    assert pp._check_recv_buffers(BASE, stage_mod) is None

    bare = types.ModuleType("fake_schedules")
    skip = pp._check_sent_outputs(None, bare)
    assert skip is not None and skip.reason is Reason.TARGET_NOT_FOUND
    assert "_batch_p2p" in skip.detail
    assert pp._check_sent_outputs(None, schedules) is None
    skip = pp._check_step_state(None, bare)
    assert skip is not None and skip.reason is Reason.TARGET_NOT_FOUND


def test_a_receive_it_does_not_know_is_left_to_torch_and_said_once() -> None:
    """A tensor subclass in the receive buffer: torch's own code runs, one PatchWarning."""
    leakfree.patch_all()
    meta = stage_mod._TensorMeta.from_tensor(torch.zeros(2, 3, requires_grad=True))
    buffer = torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False)
    info = stage_mod._RecvInfo("x", 0, buffer, meta)
    stage = types.SimpleNamespace(args_recv_info={0: (info,)}, has_backward=True, stage_index=1)
    with pytest.warns(leakfree.PatchWarning, match="left untouched"):
        (first,) = BASE._retrieve_recv_activations(stage, 0)
    assert first is buffer and first.requires_grad  # torch's: the buffer, made a leaf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        BASE._retrieve_recv_activations(stage, 0)  # said once only


def test_a_plain_receive_becomes_a_fresh_non_leaf_per_microbatch() -> None:
    leakfree.patch_all()
    meta = stage_mod._TensorMeta.from_tensor(torch.zeros(2, 3, requires_grad=True))
    buffer = torch.arange(6.0).view(2, 3)
    info = stage_mod._RecvInfo("x", 0, buffer, meta)
    stage = types.SimpleNamespace(args_recv_info={0: (info,)}, has_backward=True, stage_index=1)
    (a,) = BASE._retrieve_recv_activations(stage, 0)
    (b,) = BASE._retrieve_recv_activations(stage, 0)
    assert a is not b and a is not buffer
    assert not a.is_leaf and a.grad_fn is not None and not buffer.requires_grad
    assert torch.equal(a, buffer) and a.data_ptr() == buffer.data_ptr()  # no copy
    a.register_hook(lambda g: None)
    assert not buffer._backward_hooks  # the hook is the microbatch's, not the buffer's
    stage.has_backward = False  # evaluation: an alias, still never the buffer itself
    (c,) = BASE._retrieve_recv_activations(stage, 0)
    assert c is not buffer and c.is_leaf and not c.requires_grad


def test_input_gradient_from_the_slot_has_the_inputs_layout() -> None:
    """What torch would have read from a leaf's .grad: dense, the input's strides."""
    leakfree.patch_all()
    meta = stage_mod._TensorMeta.from_tensor(torch.zeros(4, 3, requires_grad=True))
    info = stage_mod._RecvInfo("x", 0, torch.randn(4, 3), meta)
    stage = types.SimpleNamespace(args_recv_info={0: (info,)}, has_backward=True, stage_index=1)
    (x,) = BASE._retrieve_recv_activations(stage, 0)
    out = x.sum(0, keepdim=True)  # its gradient reaches x expanded (stride 0)
    (grad,) = stage_mod.stage_backward((out,), (torch.ones(1, 3),), [x])
    leaf = info.buffer.detach().requires_grad_()
    (expected,) = get_original(stage_mod, "stage_backward")(
        (leaf.sum(0, keepdim=True),), (torch.ones(1, 3),), [leaf]
    )
    assert torch.equal(grad, expected) and grad.stride() == expected.stride() == (3, 1)


@pytest.mark.parametrize("schedule", ["ScheduleZBVZeroBubble", "ScheduleDualPipeV"])
def test_v_schedules_on_one_rank(group: None, schedule: str) -> None:
    plain = P.run(P.Config(schedule, patch=None, steps=3, dim=16), 0, 1)
    fixed = P.run(P.Config(schedule, patch={}, steps=3, dim=16), 0, 1)
    assert fixed.grads == plain.grads and all(fixed.grads_equal_reference)
    assert fixed.losses == plain.losses == fixed.reference_losses
    assert len(set(fixed.live_bytes)) == 1
    # the step's end: the last stage's output chunks and the locally passed inputs go
    assert fixed.live_bytes[-1] < plain.live_bytes[-1]
    sink = P.run(P.Config(schedule, patch={}, steps=3, dim=16, sink="PipelineLosses"), 0, 1)
    assert sink.live_bytes == sink.caller_bytes  # nothing but the detached losses


class Boom(RuntimeError):
    pass


def _one_rank_schedule(loss_fn: Any) -> tuple[Any, list[Any]]:
    from torch import nn
    from torch.distributed import pipelining

    torch.manual_seed(0)
    parts = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)]
    stages = [pipelining.PipelineStage(p, i, 2, torch.device("cpu")) for i, p in enumerate(parts)]
    return pipelining.ScheduleZBVZeroBubble(stages, n_microbatches=2, loss_fn=loss_fn), stages


def test_a_failing_step_raises_its_own_error_and_leaves_nothing(group: None) -> None:
    leakfree.patch_all()
    calls = [0]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 4:
            raise Boom("loss failed")
        return torch.nn.functional.mse_loss(out, target)

    schedule, stages = _one_rank_schedule(loss_fn)
    schedule.step(torch.randn(4, 4), target=torch.zeros(4, 4))
    with pytest.raises(Boom, match="loss failed"):
        schedule.step(torch.randn(4, 4), target=torch.zeros(4, 4))
    for stage in stages:
        assert stage.fwd_cache == {} and stage.output_chunks == []
    # stage 1 receives locally from stage 0: no input of the failed step is left on it
    assert [i.buffer for infos in stages[1].args_recv_info.values() for i in infos] == [None, None]


def test_bookkeeping_that_fails_never_breaks_the_step(
    group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise KeyError("ledger")

    schedule, _ = _one_rank_schedule(torch.nn.functional.mse_loss)
    leakfree.patch_all()
    monkeypatch.setattr(pp, "_end_step", broken)  # what the step's end calls, guarded
    leakfree.unpatch_all()
    leakfree.patch_all()
    with pytest.warns(leakfree.PatchWarning, match=r"broken failed \(KeyError: 'ledger'\)"):
        schedule.step(torch.randn(4, 4), target=torch.zeros(4, 4))
    leakfree.unpatch_all()
    leakfree.patch_all(strict=True)
    with pytest.raises(KeyError, match="ledger"):
        schedule.step(torch.randn(4, 4), target=torch.zeros(4, 4))


def test_config_is_data() -> None:  # the harness's knobs, as the integration tests pass them
    assert P.Config(**dataclasses.asdict(P.Config("Schedule1F1B", patch={}))).patch == {}


class _Stage:
    """What the ledger keys its records by (weakly): any object that takes a weakref."""


def _sent_output() -> tuple[torch.Tensor, torch.Tensor, Any]:
    lin = torch.nn.Linear(4, 4)
    y = lin(torch.randn(2, 4))  # addmm saves its inputs, not its output: freeable
    alias = y.detach()  # what torch posts the send with
    return y, alias, dist.P2POp(dist.isend, alias, 0)


def _completed_work() -> Any:
    """A real gloo Work that reports completion without a wait (an async all_reduce on a
    one-rank group; a gloo send's Work never does, NCCL's do)."""
    import time

    work = dist.all_reduce(torch.zeros(1), async_op=True)
    deadline = time.monotonic() + 30
    while not work.is_completed():
        assert time.monotonic() < deadline, "the all_reduce never completed"
        time.sleep(0.001)
    return work


def test_send_ledger_releases_on_poll_and_on_wait(group: None) -> None:
    from torch.multiprocessing.reductions import StorageWeakRef

    stage = _Stage()
    ledger = pp.SendLedger()
    y, alias, op = _sent_output()
    storage = StorageWeakRef(y.untyped_storage())
    ledger.note(stage, [y], [op])
    work = _completed_work()
    ledger.posted([op], [work])
    assert not storage.expired()
    ledger.poll()  # is_completed() said so: released without anybody waiting
    assert storage.expired() and y.shape == (2, 4) and alias.untyped_storage().nbytes() == 4
    assert ledger.released == 1 and ledger.released_bytes == 2 * 4 * 4

    # one coalesced Work for two ops (batch_isend_irecv may return fewer works than ops):
    # the output goes only once every Work its sends ride on is complete
    y, alias, op = _sent_output()
    storage = StorageWeakRef(y.untyped_storage())
    ledger.note(stage, [y], [op])
    first, second = _completed_work(), _completed_work()
    recv = dist.P2POp(dist.irecv, torch.empty(1), 0)
    ledger.posted([op, recv, recv], [first, second])
    ledger.completed([first])
    assert not storage.expired()
    ledger.completed([second])
    assert storage.expired()

    # a step that ends with a send never known complete: nothing is kept for it
    y, alias, op = _sent_output()
    ledger.note(stage, [y], [op])
    ledger.posted([op], [_completed_work()])
    ledger.forget([stage])
    assert ledger._by_work == {} and ledger._by_tensor == {}


def test_send_ledger_leaves_what_it_must_not_free(group: None) -> None:
    """A view, an output its own node saved, an alias it was not told about: untouched."""
    from torch.multiprocessing.reductions import StorageWeakRef

    stage = _Stage()
    ledger = pp.SendLedger()
    w = torch.randn(4, requires_grad=True)
    saved = torch.sigmoid(w * 2)  # SigmoidBackward saves its output
    view = (w * 3)[:2]
    for y in (saved, view):
        alias = y.detach()
        op = dist.P2POp(dist.isend, alias, 0)
        ledger.note(stage, [y], [op])
        work = _completed_work()
        ledger.posted([op], [work])
        ledger.completed([work])
    assert ledger.released == 0
    y, alias, op = _sent_output()
    other = y.detach()  # someone else's alias: the storage is not ours to free
    storage = StorageWeakRef(y.untyped_storage())
    ledger.note(stage, [y], [op])
    work = _completed_work()
    ledger.posted([op], [work])
    ledger.completed([work])
    assert not storage.expired() and torch.equal(other, y)


def test_split_backward_of_a_non_leaf_input_is_quiet_and_keeps_no_grad() -> None:
    """Zero-bubble schedules run the input half with ``stage_backward_input``, which sets
    ``inp.grad``: on a non-leaf torch warns, and the gradient would stay on the input until
    the weight half. The patch silences exactly that warning and drops that ``.grad``."""
    leakfree.patch_all()
    meta = stage_mod._TensorMeta.from_tensor(torch.zeros(2, 4, requires_grad=True))
    info = stage_mod._RecvInfo("x", 0, torch.randn(2, 4), meta)
    stage = types.SimpleNamespace(args_recv_info={0: (info,)}, has_backward=True, stage_index=1)
    (x,) = BASE._retrieve_recv_activations(stage, 0)
    lin = torch.nn.Linear(4, 4)
    out = lin(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (dx,), _ = stage_mod.stage_backward_input([out], [torch.ones(2, 4)], [x], lin.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reading a non-leaf's .grad warns too
        assert x.grad is None
    assert torch.equal(dx, torch.ones(2, 4) @ lin.weight.detach())
