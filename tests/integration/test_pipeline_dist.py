"""Hand-written pipelines between processes (gloo on 127.0.0.1, spawned by each test,
bounded in time): leakfree's primitives wired by the reference schedule of
examples/pipeline_two_stages.py (``run_schedule``), and the p2p failure paths: aborts that
reach a waiting peer at once, timeouts on a stuck one, header mismatches.

``torch.distributed.pipelining`` itself is tested in test_pipelining.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from leakfree import pipeline
from tests._dist import run_workers

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pipeline_two_stages.py"


def _example() -> Any:
    """examples/pipeline_two_stages.py as a module (the reference ``run_schedule``)."""
    import importlib.util
    import sys

    module = sys.modules.get("pipeline_two_stages")
    if module is None:
        spec = importlib.util.spec_from_file_location("pipeline_two_stages", EXAMPLE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["pipeline_two_stages"] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return module


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
    result = _example().run_schedule(
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


# --- bounded failure --------------------------------------------------------------------------


def _failing_worker(
    rank: int, world: int, mode: str, timeout: float, schedule: str = "1f1b"
) -> dict[str, Any]:
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
        _example().run_schedule(
            first_stage if rank == 0 else stage,
            stage_id=rank,
            num_stages=world,
            num_microbatches=6,
            inputs=lambda i: _data(i)[0],
            loss_fn=_loss,
            timeout=timeout,
            schedule=schedule,
        )
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - t0
    if rank == 0 and mode == "raises":
        time.sleep(timeout)  # the failed rank stays alive: its peer must not wait for it
    return {"error": error, "elapsed": elapsed}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_stage_failure_reaches_the_peer_at_once(tmp_path: Path, schedule: str) -> None:
    # The failed stage drops the abort's work and its sends in flight (run_schedule waits
    # for neither): gloo cancels a dropped send, so before send_abort kept both, the abort
    # never arrived under gpipe, and under 1f1b it depended on timing
    results = run_workers(_failing_worker, 2, tmp_path, "raises", 6.0, schedule, timeout=120)
    assert results[0]["error"].startswith("ValueError: boom in stage 0")
    assert results[1]["error"].startswith("PipelineAborted: recv_forward: rank 0 failed")
    assert results[1]["elapsed"] < 3  # told at once, not timed out (the timeout is 6 s)


def test_receive_times_out_on_a_stuck_peer(tmp_path: Path) -> None:
    # A timed-out receive leaves gloo's connection closed: no final barrier on that group.
    results = run_workers(_failing_worker, 2, tmp_path, "stuck", 1.0, timeout=120, barrier=False)
    assert results[1]["error"].startswith("PipelineTimeout: recv_forward from rank 0")
    assert 0.8 < results[1]["elapsed"] < 6


def test_reference_schedule_argument_errors() -> None:
    run_schedule = _example().run_schedule
    with pytest.raises(ValueError, match="schedule='zb'"):
        run_schedule(nn.Identity(), stage_id=0, num_stages=1, num_microbatches=1, schedule="zb")
    with pytest.raises(ValueError, match="needs inputs="):
        run_schedule(nn.Identity(), stage_id=0, num_stages=2, num_microbatches=1)
    with pytest.raises(ValueError, match="needs loss_fn="):
        run_schedule(nn.Identity(), stage_id=1, num_stages=2, num_microbatches=1)
