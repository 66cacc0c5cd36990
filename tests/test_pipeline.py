"""leakfree.pipeline: non-leaf receive buffers, slots, released outputs, real gloo pipelines."""

from __future__ import annotations

import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from leakfree import pipeline
from leakfree.pipeline import (
    GradSlot,
    PipelineWarning,
    RecvBufferPool,
    as_nonleaf,
    backward_from,
    release_output,
)
from tests._dist import run_workers

# --- non-leaf receive -------------------------------------------------------------------------


def test_as_nonleaf_properties() -> None:
    buf = torch.randn(4, 3)
    slot = GradSlot()
    x = as_nonleaf(buf, slot)
    assert x.grad_fn is not None and not x.is_leaf and x.requires_grad
    assert x.data_ptr() == buf.data_ptr()  # an alias: no copy
    assert not buf.requires_grad and buf.is_leaf
    w = torch.randn(3, 2, requires_grad=True)
    (x @ w).sum().backward()
    expect = torch.ones(4, 2) @ w.detach().T
    assert torch.equal(slot.take(), expect)
    assert buf.grad is None
    anchor = x.grad_fn.next_functions[0][0].variable
    assert anchor.numel() == 0 and anchor.grad is None  # the anchor never accumulates
    # no accumulation node for the buffer anywhere in the graph
    assert all(
        fn is None or getattr(fn, "variable", None) is not buf for fn, _ in x.grad_fn.next_functions
    )


def test_in_place_on_received_activation_allowed_and_versioned() -> None:
    buf = torch.zeros(3)
    x = as_nonleaf(buf, GradSlot())
    x.add_(1.0)  # allowed (an alias, not a custom-Function view)
    assert torch.equal(buf, torch.ones(3))
    w = torch.ones(3, requires_grad=True)
    y = (x * w).sum()  # MulBackward saves x
    buf.fill_(5.0)  # overwriting the buffer before backward: autograd notices
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def _leaf_receive(buf: torch.Tensor) -> torch.Tensor:
    return buf.detach().requires_grad_()  # the usual leaf receive


def test_nothing_retained_after_backward(no_gc: None) -> None:
    """Non-leaf: buffer and gradient free once we drop them. Leaf: .grad pins the gradient."""
    w = torch.randn(64, 64, requires_grad=True)
    # leaf receive: the gradient stays in .grad on the leaf
    buf = torch.randn(32, 64)
    leaf = _leaf_receive(buf)
    (leaf @ w).sum().backward()
    leaf_grad = weakref.ref(leaf.grad)
    del buf
    assert leaf_grad() is not None  # kept until someone clears it
    # non-leaf receive
    buf = torch.randn(32, 64)
    storage = StorageWeakRef(buf.untyped_storage())
    slot = GradSlot()
    x = as_nonleaf(buf, slot)
    out = (x @ w).sum()
    del buf, x
    assert not storage.expired()  # saved by MmBackward for backward: needed
    out.backward()
    g = slot.take()
    grad_ref = weakref.ref(g)
    del g
    assert grad_ref() is None  # autograd kept no reference to the gradient
    # `out` (and so the graph) is alive, but nothing in it holds the buffer any more:
    # MmBackward's saved x was freed by backward, and there is no accumulation node
    assert storage.expired()
    del out


def test_as_nonleaf_bad_input() -> None:
    with pytest.raises(ValueError, match="requires grad"):
        as_nonleaf(torch.randn(2, requires_grad=True), GradSlot())
    with pytest.raises(ValueError, match="cannot carry a gradient"):
        as_nonleaf(torch.ones(2, dtype=torch.int64), GradSlot())
    with pytest.raises(TypeError, match="GradSlot"):
        as_nonleaf(torch.ones(2), object())  # type: ignore[arg-type]


def test_grad_slot_second_gradient_and_accumulate() -> None:
    buf = torch.randn(3)
    slot = GradSlot()
    x = as_nonleaf(buf, slot)
    y = (x * 2).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second gradient before take"):
        y.backward(retain_graph=True)
    assert torch.equal(slot.take(), torch.full((3,), 2.0))
    with pytest.raises(RuntimeError, match="no gradient was delivered"):
        slot.take()
    acc = GradSlot(accumulate=True)
    x = as_nonleaf(buf, acc)
    y = (x * 2).sum()
    y.backward(retain_graph=True)
    y.backward()
    assert torch.equal(acc.take(), torch.full((3,), 4.0))
    seen: list[torch.Tensor] = []
    fwd = GradSlot(seen.append)
    (as_nonleaf(buf, fwd) * 3).sum().backward()
    assert not fwd.ready and torch.equal(seen[0], torch.full((3,), 3.0))


# --- receive buffer pool ----------------------------------------------------------------------


def test_pool_reuses_only_after_delivery() -> None:
    pool = RecvBufferPool()
    w = torch.randn(3, requires_grad=True)
    a = pool.acquire((3,), torch.float32, "cpu")
    b = pool.acquire((3,), torch.float32, "cpu")
    assert a.tensor.data_ptr() != b.tensor.data_ptr()  # a is still needed
    ya = (a.activation * w).sum()
    a.activation = None
    c = pool.acquire((3,), torch.float32, "cpu")
    assert c.tensor.data_ptr() not in (a.tensor.data_ptr(), b.tensor.data_ptr())
    ya.backward()  # a's slot delivers: its buffer returns
    a.slot.take()
    d = pool.acquire((3,), torch.float32, "cpu")
    assert d.tensor is a.tensor
    assert pool.counters.allocated == 3 and pool.counters.reused == 1
    e = pool.acquire((4,), torch.float32, "cpu")  # another shape: another buffer
    assert e.tensor.shape == (4,)


def test_pool_takes_back_buffers_of_dropped_graphs(no_gc: None) -> None:
    pool = RecvBufferPool()
    entry = pool.acquire((8,), torch.float32, "cpu")
    y = (entry.activation * 2).sum()
    entry.activation = None
    buf_ptr = entry.tensor.data_ptr()
    del y, entry  # forward without backward (evaluation, a dropped microbatch)
    assert pool.counters.in_use == 0
    assert pool.acquire((8,), torch.float32, "cpu").tensor.data_ptr() == buf_ptr


# --- sending side -----------------------------------------------------------------------------


def test_release_output_frees_and_backward_from_matches() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16)
    expect = torch.autograd.grad(lin(x).sum(), list(lin.parameters()))
    y = lin(x)  # addmm does not save its output
    storage = StorageWeakRef(y.untyped_storage())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle = release_output(y)
    assert handle.freed and y.numel() == 0
    assert storage.expired()  # the memory is gone; y holds an empty storage
    backward_from(handle, torch.ones(4, 16))
    for p, e in zip(lin.parameters(), expect):
        assert torch.equal(p.grad, e)


@pytest.mark.parametrize("which", ["parameter", "leaf"])
def test_release_output_refuses_leaves_before_touching_them(which: str) -> None:
    lin = nn.Linear(4, 4)
    t = lin.weight if which == "parameter" else torch.randn(3, requires_grad=True)
    before = t.detach().clone()
    what = "a parameter" if which == "parameter" else "a leaf tensor"
    with pytest.raises(ValueError, match=rf"release_output\(y=...\): y is {what} .*not the output"):
        release_output(t)
    assert torch.equal(t.detach(), before)  # not emptied


def test_release_output_twice_is_refused() -> None:
    lin = nn.Linear(16, 16)
    y = lin(torch.randn(4, 16))
    handle = release_output(y)
    with pytest.raises(ValueError, match=r"already released \(it was \(4, 16\), torch.float32\)"):
        release_output(y)
    assert handle.shape == (4, 16)
    backward_from(handle, torch.ones(4, 16))
    assert lin.weight.grad is not None


def test_release_output_refuses_when_storage_is_saved() -> None:
    w = torch.randn(8, requires_grad=True)
    y = torch.sigmoid(w * 2)  # SigmoidBackward saves its output
    with pytest.warns(PipelineWarning, match="still referenced elsewhere"):
        handle = release_output(y)
    assert not handle.freed and y.untyped_storage().nbytes() == 8 * 4
    backward_from(handle, torch.ones(8))
    s = torch.sigmoid(w.detach() * 2)
    assert torch.equal(w.grad, 2 * s * (1 - s))
    v = (w * 3)[:4]
    with pytest.warns(PipelineWarning, match="view"):
        release_output(v)


def test_release_output_never_leaves_a_saved_input_reading_freed_memory() -> None:
    """A later op saved y as an *input* (same TensorImpl: no storage reference to count)."""
    lin = nn.Linear(8, 8)
    y = lin(torch.randn(2, 8))
    aux = (y * y).sum()  # MulBackward saves y itself
    handle = release_output(y)
    assert handle.freed
    assert y.numel() == 0  # a user holding y reads an empty tensor, not freed memory
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        aux.backward()


def test_receive_under_no_grad_and_inference_mode() -> None:
    buf = torch.randn(3)
    with torch.no_grad():  # evaluation: still a non-leaf whose gradient has a place to go
        x = as_nonleaf(buf, GradSlot())
    assert x.grad_fn is not None and not x.is_leaf
    pool = RecvBufferPool()
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="inference_mode"):
            as_nonleaf(buf, GradSlot())
        with pytest.raises(RuntimeError, match="inference_mode"):
            pool.acquire((3,), torch.float32, "cpu")
    assert pool.counters.in_use == 0 and pool.counters.allocated == 0


def test_release_and_backward_bad_input() -> None:
    with pytest.raises(ValueError, match="does not require grad"):
        release_output(torch.ones(3))
    w = torch.randn(3, requires_grad=True)
    handle = release_output(w * 2)
    with pytest.raises(
        ValueError, match=r"gradient \(4,\) torch.float32 on cpu does not match.*\(3,\)"
    ):
        backward_from(handle, torch.ones(4))
    with pytest.raises(TypeError, match="release_output returned"):
        backward_from(w, torch.ones(3))  # type: ignore[arg-type]


def test_schedule_argument_errors() -> None:
    with pytest.raises(ValueError, match="schedule='zb'"):
        pipeline.run_schedule(
            nn.Identity(), stage_id=0, num_stages=1, num_microbatches=1, schedule="zb"
        )
    with pytest.raises(ValueError, match="needs inputs="):
        pipeline.run_schedule(nn.Identity(), stage_id=0, num_stages=2, num_microbatches=1)
    with pytest.raises(ValueError, match="needs loss_fn="):
        pipeline.run_schedule(nn.Identity(), stage_id=1, num_stages=2, num_microbatches=1)


# --- real pipelines: gloo on 127.0.0.1 --------------------------------------------------------

D = 16


def _full_model() -> nn.Sequential:
    torch.manual_seed(1234)
    layers: list[nn.Module] = []
    for _ in range(6):
        # Linear last in each pair: every stage's output is a Linear output, which no node
        # saves, so release_output can free it (a Tanh output is saved by TanhBackward)
        layers += [nn.Tanh(), nn.Linear(D, D)]
    return nn.Sequential(*layers)


def _chunks(model: nn.Sequential, n: int) -> list[nn.Sequential]:
    per = len(model) // n
    return [nn.Sequential(*list(model)[i * per : (i + 1) * per]) for i in range(n)]


def _data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(4, D, generator=g), torch.randn(4, D, generator=g)


def _loss(y: torch.Tensor, i: int) -> torch.Tensor:
    return nn.functional.mse_loss(y, _data(i)[1])


def _single_process(num_stages: int, m: int) -> list[list[list[float]]]:
    stages = _chunks(_full_model(), num_stages)
    model = nn.Sequential(*stages)
    for i in range(m):
        _loss(model(_data(i)[0]), i).backward()
    return [[p.grad.flatten().tolist() for p in s.parameters()] for s in stages]


def _pipeline_worker(rank: int, world: int, schedule: str, m: int) -> dict[str, Any]:
    stage = _chunks(_full_model(), world)[rank]
    result = pipeline.run_schedule(
        stage,
        stage_id=rank,
        num_stages=world,
        num_microbatches=m,
        inputs=lambda i: _data(i)[0],
        loss_fn=_loss,
        schedule=schedule,
    )
    return {
        "grads": [p.grad.flatten().tolist() for p in stage.parameters()],
        "losses": result.losses,
        "live": result.live_bytes,
        "buffers": result.pool.counters.allocated,
        "freed": result.freed_outputs,
    }


@pytest.mark.parametrize(("world", "schedule"), [(2, "1f1b"), (2, "gpipe"), (3, "1f1b")])
def test_pipeline_gradients_bit_identical_to_one_process(
    world: int, schedule: str, tmp_path: Path
) -> None:
    m = 6
    results = run_workers(_pipeline_worker, world, tmp_path, schedule, m, timeout=120)
    expect = _single_process(world, m)
    for rank, r in enumerate(results):
        assert r["grads"] == expect[rank], f"stage {rank}"
    assert len(results[-1]["losses"]) == m
    for r in results[:-1]:
        assert r["freed"] == m  # every sent output's memory was released after its send
    if schedule == "1f1b":
        # receive buffers: as many as microbatches in flight on that stage, not m
        for rank in range(1, world):
            assert results[rank]["buffers"] <= world - rank


def test_hundred_microbatches_flat_live_bytes(tmp_path: Path) -> None:
    results = run_workers(_pipeline_worker, 2, tmp_path, "1f1b", 100, timeout=120)
    for r in results:
        live = r["live"]
        assert len(live) == 100
        # flat: the last 50 microbatches never hold more than the first few did (an output
        # whose isend is still completing may be counted at one sample and not the next)
        assert max(live[50:]) <= max(live[:5])
        assert max(live) <= 2 * 4 * D * 4  # one buffer / one in-flight output, at most
    assert results[1]["buffers"] == 1


def _mismatch_worker(rank: int, world: int) -> dict[str, Any]:
    if rank == 0:
        pipeline.send_forward(torch.randn(2, 3), 1)
        pipeline.send_forward(torch.randn(2, 3), 1)
        return {}
    try:
        pipeline.recv_forward(0, shape=(3, 2), dtype=torch.float32)
    except ValueError as e:
        first = str(e)
    entry = pipeline.recv_forward(0, shape=(2, 3), dtype=torch.float32)  # stream still in sync
    return {"error": first, "shape": list(entry.tensor.shape), "version": entry.tensor._version}


def test_p2p_shape_mismatch_names_both(tmp_path: Path) -> None:
    results = run_workers(_mismatch_worker, 2, tmp_path, timeout=60)
    assert "rank 0 sent (2, 3) torch.float32" in results[1]["error"]
    assert "receiving buffer is (3, 2) torch.float32" in results[1]["error"]
    assert results[1]["shape"] == [2, 3]
    assert results[1]["version"] >= 1  # recv bumps the version: stale aliases are caught


def test_dist_is_not_left_initialised() -> None:
    assert not (dist.is_available() and dist.is_initialized())


# --- [2/6]: bounded failure -------------------------------------------------------------------


def _failing_worker(rank: int, world: int, mode: str, timeout: float) -> dict[str, Any]:
    import time

    stage = _chunks(_full_model(), world)[rank]
    calls = [0]

    def first_stage(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3:
            if mode == "raises":
                raise ValueError("boom in stage 0")
            time.sleep(3 * timeout)  # "stuck": alive, never sends
        return stage(x)

    t0 = time.monotonic()
    try:
        pipeline.run_schedule(
            first_stage if rank == 0 else stage,
            stage_id=rank,
            num_stages=world,
            num_microbatches=6,
            inputs=lambda i: _data(i)[0],
            loss_fn=_loss,
            timeout=timeout,
        )
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - t0
    if rank == 0 and mode == "raises":
        time.sleep(timeout)  # the failed rank stays alive: its peer must not wait for it
    return {"error": error, "elapsed": elapsed}


def test_run_schedule_failure_reaches_the_peer_at_once(tmp_path: Path) -> None:
    results = run_workers(_failing_worker, 2, tmp_path, "raises", 6.0, timeout=120)
    assert results[0]["error"].startswith("ValueError: boom in stage 0")
    assert results[1]["error"].startswith("PipelineAborted: recv_forward: rank 0 failed")
    assert results[1]["elapsed"] < 3  # told at once, not timed out (the timeout is 6 s)


def test_run_schedule_times_out_on_a_stuck_peer(tmp_path: Path) -> None:
    # A timed-out receive leaves gloo's connection closed: no final barrier on that group.
    results = run_workers(_failing_worker, 2, tmp_path, "stuck", 1.0, timeout=120, barrier=False)
    assert results[1]["error"].startswith("PipelineTimeout: recv_forward from rank 0")
    assert 0.8 < results[1]["elapsed"] < 6
