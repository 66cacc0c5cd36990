"""The default pinned host memory budget is the node's, divided among its ranks: two
ranks on one machine (gloo on 127.0.0.1, started by the test as torchrun would start
them) each get half of what one alone gets."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest

import leakfree
from leakfree.offload.pool import PROCESS_BUDGET
from tests._dist import run_workers


def _node_share_worker(rank: int, world: int) -> dict[str, Any]:
    from tests.test_offload import make

    model, x = make(rank)
    ctx = leakfree.OffloadActivations(force_host_copy=True, min_offload_size=256)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ctx:
            loss = model(x).square().mean()
        loss.backward()
    return {
        "budget": ctx.pool.budget,
        "process": PROCESS_BUDGET.limit,
        "physical": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "warnings": [str(w.message) for w in caught],
        "moved": ctx.stats.to_host_bytes,
        "overflows": ctx.pool.stats.overflows,
    }


def test_two_local_ranks_each_get_half_the_node_s_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # what torchrun sets for two ranks a node
    ranks = run_workers(_node_share_worker, 2, tmp_path, timeout=60)
    quarter = ranks[0]["physical"] // 4
    for r in ranks:
        assert r["budget"] == r["process"] == quarter // 2, r
        assert r["moved"] > 0 and r["overflows"] == 0  # it offloaded, within its half
        assert r["warnings"] == []
    assert sum(r["budget"] for r in ranks) <= quarter  # the node's share, not twice it


def test_ranks_without_local_world_size_are_told_the_budget_is_per_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks on one node cannot be counted without a collective: without the launcher's
    variable each rank takes the whole share, and says so once."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    ranks = run_workers(_node_share_worker, 2, tmp_path, timeout=60)
    for r in ranks:
        assert r["budget"] == r["physical"] // 4, r
        (message,) = r["warnings"]
        assert "2 ranks and no LOCAL_WORLD_SIZE" in message and "pin_memory_budget" in message
