"""``patch_all()`` repairs torch.distributed.pipelining: every schedule torch ships, 2 and 4
gloo ranks on 127.0.0.1, unpatched against patched against one process.

The runs and what they measure are in tests/_pipelining.py (an independent dispatch-mode
count of live storages, weak references to each microbatch's output, tensor hooks that a
forward pre-hook registers on each stage input). Each repaired behaviour is asserted on the
patched run, and shown to fail with that one repair switched off
(``patch_all(torch_pipelining_<name>=False)``): a test that could not fail proves nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from leakfree.patches._registry import installed_version, version_matches
from leakfree.patches.pipelining import RELEASES
from tests import _pipelining as P
from tests._dist import run_workers

_torch = installed_version(("torch",))
pytestmark = pytest.mark.skipif(
    _torch is None or not version_matches(_torch, RELEASES),
    reason=f"the repair is built for torch {RELEASES}",
)

STEPS = 3
DIM = 16
PATCHED: dict[str, Any] = {}
BEHAVIOURS = ("stage_inputs", "sent_outputs", "recv_buffers", "step_state")


def _off(name: str) -> dict[str, Any]:
    return {f"torch_pipelining_{name}": False}


def _config(schedule: str, patch: dict[str, Any] | None, **kw: Any) -> dict[str, Any]:
    return dataclasses.asdict(P.Config(schedule=schedule, patch=patch, steps=STEPS, dim=DIM, **kw))


def _worker(rank: int, world: int, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(P.run(P.Config(**c), rank, world)) for c in configs]


def _matrix(world: int, tmp: Path, configs: list[dict[str, Any]]) -> dict[int, list[Any]]:
    """{config index: [result per rank]}"""
    per_rank = run_workers(_worker, world, tmp, configs, timeout=240)
    return {i: [per_rank[r][i] for r in range(world)] for i in range(len(configs))}


# --- two ranks: every schedule, unpatched and patched; each repair off in turn; variants ----

TWO: list[dict[str, Any]] = (
    [_config(s, patch) for s in P.ALL for patch in (None, PATCHED)]
    + [_config("Schedule1F1B", _off(name)) for name in BEHAVIOURS]
    + [
        _config(s, PATCHED, variant=v, sink="PipelineLosses")
        for s in ("Schedule1F1B", "ScheduleInterleavedZeroBubble")
        for v in ("checkpoint", "offload")
    ]
)
FOUR: list[dict[str, Any]] = [_config(s, PATCHED) for s in P.ALL] + [
    _config(s, None) for s in P.SINGLE
]


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[Any]]:
    return _matrix(2, tmp_path_factory.mktemp("two"), TWO)


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[Any]]:
    return _matrix(4, tmp_path_factory.mktemp("four"), FOUR)


def _find(configs: list[dict[str, Any]], runs: dict[int, list[Any]], **want: Any) -> list[Any]:
    for i, c in enumerate(configs):
        if all(c[k] == v for k, v in want.items()):
            return runs[i]
    raise KeyError(want)


def _last(ranks: list[Any]) -> Any:
    return next(r for r in reversed(ranks) if r["losses"])


@pytest.mark.parametrize("schedule", P.ALL)
def test_bit_identical_to_unpatched_and_to_one_process(two: Any, schedule: str) -> None:
    plain = _find(TWO, two, schedule=schedule, patch=None, variant="plain")
    fixed = _find(TWO, two, schedule=schedule, patch=PATCHED, variant="plain")
    for rank, (a, b) in enumerate(zip(plain, fixed)):
        assert b["grads"] == a["grads"], f"rank {rank}: gradients differ from unpatched"
        assert all(b["grads_equal_reference"]), f"rank {rank}: differ from one process"
        assert all(a["grads_equal_reference"])
    assert _last(fixed)["losses"] == _last(plain)["losses"] == _last(fixed)["reference_losses"]


@pytest.mark.parametrize("schedule", P.ALL)
def test_four_ranks_every_schedule(four: Any, schedule: str) -> None:
    fixed = _find(FOUR, four, schedule=schedule, patch=PATCHED)
    stages_per_rank = len(P.stage_indices(schedule, 0, 4))
    for rank, r in enumerate(fixed):
        assert all(r["grads_equal_reference"]), f"rank {rank}: differ from one process"
        assert r["recv_bytes_between"] == [0] * STEPS, rank
        assert len(set(r["live_bytes"][1:])) == 1, (rank, r["live_bytes"])
        # one fire per microbatch per stage input (stage 0 has none), every step
        receiving = stages_per_rank - (0 in P.stage_indices(schedule, rank, 4))
        assert r["hook_fires"][1:] == [receiving * P.N_MB] * (STEPS - 1), (rank, r["hook_fires"])
        assert r["input_leaves"][1:] == [0] * (STEPS - 1)
    assert _last(fixed)["losses"] == _last(fixed)["reference_losses"]


def test_four_ranks_middle_ranks_held_twice_the_buffers(four: Any) -> None:
    """Unpatched, a middle rank holds activation and gradient receive buffers between
    steps (one per microbatch each); patched, nothing."""
    for schedule in P.SINGLE:
        plain = _find(FOUR, four, schedule=schedule, patch=None)
        mb = P.BATCH // P.N_MB * DIM * 4
        assert [r["recv_bytes_between"][-1] for r in plain] == [
            P.N_MB * mb,
            2 * P.N_MB * mb,
            2 * P.N_MB * mb,
            P.N_MB * mb,
        ]


def test_hooks_on_stage_inputs_fire_once_per_microbatch(two: Any) -> None:
    plain = _find(TWO, two, schedule="ScheduleGPipe", patch=None)[1]
    fixed = _find(TWO, two, schedule="ScheduleGPipe", patch=PATCHED)[1]
    # Unpatched, each hook stays on the persistent buffer: N_MB more fires every step.
    assert plain["hook_fires"][1:] == [P.N_MB * (s + 1) for s in range(1, STEPS)]
    assert fixed["hook_fires"][1:] == [P.N_MB] * (STEPS - 1)


def test_stage_inputs_are_fresh_non_leaves(two: Any) -> None:
    fixed = _find(TWO, two, schedule="Schedule1F1B", patch=PATCHED)[1]
    off = _find(TWO, two, schedule="Schedule1F1B", patch=_off("stage_inputs"))[1]
    # (step 0 also runs torch's shape inference, on an input of its own)
    assert fixed["input_leaves"][1:] == [0] * (STEPS - 1)
    assert off["input_leaves"][1:] == [P.N_MB] * (STEPS - 1)  # the repair switched off


def test_no_receive_buffer_between_steps(two: Any) -> None:
    for rank in (0, 1):
        plain = _find(TWO, two, schedule="Schedule1F1B", patch=None)[rank]
        fixed = _find(TWO, two, schedule="Schedule1F1B", patch=PATCHED)[rank]
        off = _find(TWO, two, schedule="Schedule1F1B", patch=_off("recv_buffers"))[rank]
        mb = P.BATCH // P.N_MB * DIM * 4
        assert plain["recv_bytes_between"] == [P.N_MB * mb] * STEPS
        assert fixed["recv_bytes_between"] == [0] * STEPS
        assert off["recv_bytes_between"] == plain["recv_bytes_between"]


def test_receive_buffers_live_only_while_their_microbatch_needs_them(two: Any) -> None:
    """1F1B keeps at most 2 microbatches in flight per rank here (rank 0 of 2: warm-up 2;
    rank 1: 1): patched, the receive buffers alive at any moment of the step are those of
    the microbatches in flight plus the one being received, in each direction; unpatched,
    all 8 of each, all step long."""
    mb = P.BATCH // P.N_MB * DIM * 4
    for rank in (0, 1):
        plain = _find(TWO, two, schedule="Schedule1F1B", patch=None)[rank]
        fixed = _find(TWO, two, schedule="Schedule1F1B", patch=PATCHED)[rank]
        bound = (max(fixed["in_flight_peak"]) + 1) * mb
        assert max(fixed["recv_bytes_peak"][1:]) <= bound, (rank, fixed["recv_bytes_peak"])
        assert min(plain["recv_bytes_peak"][1:]) >= P.N_MB * mb


def test_sent_outputs_released_once_sent(two: Any) -> None:
    """1F1B: at most the one microbatch whose send is in flight; GPipe: every output is
    freed when torch waits for the sends (after the last forward), before any backward."""
    plain = _find(TWO, two, schedule="Schedule1F1B", patch=None)[0]
    fixed = _find(TWO, two, schedule="Schedule1F1B", patch=PATCHED)[0]
    off = _find(TWO, two, schedule="Schedule1F1B", patch=_off("sent_outputs"))[0]
    assert fixed["sent_alive_peak"] == [1] * STEPS
    assert plain["sent_alive_peak"] == off["sent_alive_peak"]
    assert min(plain["sent_alive_peak"]) > 1
    gpipe = _find(TWO, two, schedule="ScheduleGPipe", patch=None)[0]
    gpipe_fixed = _find(TWO, two, schedule="ScheduleGPipe", patch=PATCHED)[0]
    assert gpipe["sent_alive_at_first_backward"] == [P.N_MB] * STEPS
    assert gpipe_fixed["sent_alive_at_first_backward"] == [0] * STEPS


def test_nothing_of_the_step_held_after_it(two: Any) -> None:
    """Patched, the first rank holds nothing at all between steps, and the last rank only
    the losses it handed back (PipelineLosses: detached)."""
    for variant in ("checkpoint", "offload"):
        first, last = _find(TWO, two, schedule="Schedule1F1B", patch=PATCHED, variant=variant)
        assert first["live_bytes"] == [0] * STEPS
        assert last["live_bytes"] == last["caller_bytes"], variant
        assert last["loss_graphs"] == [0] * STEPS
    # the step-state repair off: the last stage's output chunks stay through the optimizer
    off = _find(TWO, two, schedule="Schedule1F1B", patch=_off("step_state"))[1]
    fixed = _find(TWO, two, schedule="Schedule1F1B", patch=PATCHED)[1]
    chunk = P.BATCH // P.N_MB * DIM * 4
    assert off["live_bytes"][-1] - fixed["live_bytes"][-1] >= P.N_MB * chunk


def test_live_bytes_flat_and_lower(two: Any) -> None:
    for schedule in P.ALL:
        plain = _find(TWO, two, schedule=schedule, patch=None)
        fixed = _find(TWO, two, schedule=schedule, patch=PATCHED)
        for rank, (a, b) in enumerate(zip(plain, fixed)):
            assert len(set(b["live_bytes"][1:])) == 1, (schedule, rank, b["live_bytes"])
            assert b["live_bytes"][-1] < a["live_bytes"][-1], (schedule, rank)
            assert max(b["peak_bytes"][1:]) <= max(a["peak_bytes"][1:]), (schedule, rank)


@pytest.mark.parametrize("variant", ["checkpoint", "offload"])
def test_checkpointing_and_offloading_inside_stages(two: Any, variant: str) -> None:
    for schedule in ("Schedule1F1B", "ScheduleInterleavedZeroBubble"):
        runs = _find(TWO, two, schedule=schedule, variant=variant)
        plain = _find(TWO, two, schedule=schedule, patch=None, variant="plain")
        for rank, (r, p) in enumerate(zip(runs, plain)):
            assert all(r["grads_equal_reference"]), (schedule, rank)
            assert r["grads"] == p["grads"], (schedule, rank)  # recompute: the same bits
            assert r["recv_bytes_between"] == [0] * STEPS


# --- failure ------------------------------------------------------------------------------


class Boom(RuntimeError):
    pass


def _failing(rank: int, world: int) -> dict[str, Any]:
    import time

    from torch import nn
    from torch.distributed import pipelining

    import leakfree

    leakfree.patch_all()
    torch.manual_seed(0)
    part = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    stage = pipelining.PipelineStage(part, rank, world, torch.device("cpu"))
    calls = [0]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 6:  # the second step, second microbatch
            raise Boom("the last stage failed")
        return nn.functional.mse_loss(out, target)

    schedule = pipelining.Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
    start = time.monotonic()
    try:
        for _ in range(3):
            x = torch.randn(8, 8)
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=torch.zeros(8, 8))
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    infos = (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
    left = sum(info.buffer is not None for group in infos for info in group)
    return {"error": error, "seconds": time.monotonic() - start, "buffers_left": left}


def test_a_failing_rank_ends_the_others_and_its_error_is_its_own(tmp_path: Path) -> None:
    """The last rank's loss raises in step 2: that exception reaches its caller unchanged
    (the step-end cleanup runs in ``finally`` and never replaces it); the first rank, blocked
    on a gradient that never comes, fails as soon as the peer's process is gone."""
    first, last = run_workers(_failing, 2, tmp_path, timeout=120, barrier=False)
    assert last["error"] == "Boom: the last stage failed"
    assert first["error"] is not None and "Boom" not in first["error"]
    assert first["seconds"] < 60
    # the gradient buffer the first rank was receiving into when the peer died is not kept
    assert first["buffers_left"] == last["buffers_left"] == 0
