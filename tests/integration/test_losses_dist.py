"""LossLog.reduce across processes (gloo on 127.0.0.1, spawned by the test)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import leakfree
from leakfree.diagnostics import count_host_syncs
from tests._dist import run_workers

DIST_SPEC = {
    "lm": "mean",
    "aux": "mean",
    "total": "sum",
    "best": "min",
    "worst": "max",
    "none": "max",
}


RANK_VALUES: dict[int, dict[str, list[float]]] = {
    0: {"lm": [1.0, 2.0, 3.0], "aux": [10.0], "total": [1.0, 1.0], "best": [5.0], "worst": [2.0]},
    # rank 1 has no values for "aux" and "best": it must contribute identities, not zeros
    1: {"lm": [7.0], "total": [4.0], "worst": [-3.0]},
}


def _dist_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    # orthogonal groups as in (data parallel, pipeline): dp = all ranks, pp = just me
    singles = [dist.new_group([r]) for r in range(world)]
    dp, pp = dist.group.WORLD, singles[rank]
    log = leakfree.LossLog(DIST_SPEC)
    for k, vs in RANK_VALUES[rank].items():
        log[k].extend(torch.tensor(v, requires_grad=True) * 1.0 for v in vs)
    with profile(activities=[ProfilerActivity.CPU]) as prof, count_host_syncs() as syncs:
        out = log.reduce(groups=(dp, pp))
    collectives = sum(1 for e in prof.events() if e.name == "gloo:all_reduce")
    running = leakfree.LossLog(DIST_SPEC, running=True)
    for k, vs in RANK_VALUES[rank].items():
        for v in vs:
            running[k].append(torch.tensor(v))
    out_running = running.reduce(groups=(dp,))
    plain, alone = leakfree.LossLog(DIST_SPEC), leakfree.LossLog(DIST_SPEC)
    for k, vs in RANK_VALUES[rank].items():
        plain[k].extend(torch.tensor(v) for v in vs)
        alone[k].extend(torch.tensor(v) for v in vs)
    out_plain = plain.reduce()  # the default group: every rank
    out_alone = alone.reduce(groups=())  # this rank only
    return {
        "out": {k: (None if math.isnan(v) else v) for k, v in out.items()},
        "out_running": {k: (None if math.isnan(v) else v) for k, v in out_running.items()},
        "out_plain": {k: (None if math.isnan(v) else v) for k, v in out_plain.items()},
        "out_alone": {k: (None if math.isnan(v) else v) for k, v in out_alone.items()},
        "collectives": collectives,
        "syncs": syncs.count,
        "cleared": all(len(log[k]) == 0 for k in log),
    }


def test_two_process_reduce_unbiased_one_collective_per_op(tmp_path: Path) -> None:
    results = run_workers(_dist_worker, 2, tmp_path, timeout=120)
    merged: dict[str, list[float]] = {k: [] for k in DIST_SPEC}
    for per_rank in RANK_VALUES.values():
        for k, vs in per_rank.items():
            merged[k] += vs
    expected = {
        "lm": sum(merged["lm"]) / len(merged["lm"]),  # 13/4, not mean of rank means (4.0)
        "aux": 10.0,  # rank 1 contributes (0, 0), not a zero value: not 5.0
        "total": 6.0,
        "best": 5.0,  # rank 1 contributes +inf: not min(5, 0)
        "worst": 2.0,
        "none": None,  # no values on any rank: nan
    }
    for r in results:
        assert r["out"] == expected
        assert r["out_running"] == expected
        assert r["out_plain"] == expected
    local = [
        {
            k: (
                sum(vs) / len(vs)
                if DIST_SPEC[k] == "mean"
                else {"sum": sum, "min": min, "max": max}[DIST_SPEC[k]](vs)
            )
            for k, vs in RANK_VALUES[rank].items()
        }
        for rank in sorted(RANK_VALUES)
    ]
    for rank, r in enumerate(results):
        assert {k: v for k, v in r["out_alone"].items() if v is not None} == local[rank]
        # ops present: sum (sum+mean+counts), min, max -> 3 collectives per group, 2 groups
        assert r["collectives"] == 6
        assert r["syncs"] == 1
        assert r["cleared"]


def _last_stage_reduces_alone(rank: int, world: int) -> dict[str, Any]:
    import time

    log = leakfree.LossLog(["loss"])
    log["loss"].append(torch.tensor(2.0))
    if rank == 0:  # the first stage has no losses, and never calls reduce
        time.sleep(4)  # alive meanwhile: the collective waits for it, as in a pipeline
        return {}
    started = time.monotonic()
    try:
        log.reduce(timeout=1.5)  # the default group: every rank, rank 0 included
    except TimeoutError as e:
        caught = str(e)
    waited = time.monotonic() - started
    return {"caught": caught, "waited": waited, "kept": len(log["loss"]),
            "alone": log.reduce(groups=())}  # fmt: skip


def test_a_last_stage_reducing_alone_over_the_default_group_is_told_so_in_bounded_time(
    tmp_path: Path,
) -> None:
    """A pipeline's last stage calling ``reduce()`` alone: the collective over the
    default group cannot complete; it raises, naming the group and the fix, after
    ``timeout`` (it waited for the group's 30-minute timeout before), and keeps the log."""
    _, last = run_workers(_last_stage_reduces_alone, 2, tmp_path, timeout=60, barrier=False)
    assert "default process group (2 ranks)" in last["caught"]
    assert "groups=()" in last["caught"] and "did not call reduce()" in last["caught"]
    assert 1.5 <= last["waited"] < 30
    assert last["kept"] == 1 and last["alone"] == {"loss": 2.0}
