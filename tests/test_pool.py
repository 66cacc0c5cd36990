"""The host block pool and its budget: a node's share, blocks made between steps, and
pinned bytes counted until PyTorch's host allocator really gives them back.

On the CPU, ``force_host_copy=True`` runs the pool as on a device (restored tensors view
their blocks, so each step's blocks leave the pool with its graph); pinned blocks and
device events are the simulated accelerator's (``tests/simdev``).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import leakfree
from leakfree.offload import OffloadWarning
from leakfree.offload.pool import (
    PROCESS_BUDGET,
    HostBlockPool,
    HostBudget,
    default_budget,
    release_host_cache,
)
from tests.test_offload import make, offload

# --- the default budget: a node's share, divided among its local ranks -------------------------


def test_the_default_budget_is_divided_among_the_local_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eight ranks on a node each took a quarter of its memory: twice what it has."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    one = default_budget()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert default_budget() == one // 8
    assert HostBudget().limit == one // 8  # a budget of the default size, decided now
    assert offload(pin_memory_budget=8192).pool.budget == 8192  # explicit: this process's
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert default_budget() == one  # no launcher said: one rank on this node


@pytest.mark.parametrize("bad", ["abc", "0", "-2", "", "1.5"])
def test_a_bad_local_world_size_warns_naming_it_and_counts_one_rank(
    monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    one = default_budget()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
    with pytest.warns(OffloadWarning, match=f"LOCAL_WORLD_SIZE={bad!r}: .*pin_memory_budget"):
        assert default_budget() == one


def test_a_default_budget_is_decided_at_its_first_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """PROCESS_BUDGET is made at import; a launcher that sets LOCAL_WORLD_SIZE later, before
    the first offloaded step, is heard all the same."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    budget = HostBudget()  # as PROCESS_BUDGET is, at import
    whole = default_budget()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert budget.limit == whole // 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert budget.limit == whole // 4  # decided once


def test_each_offloader_can_have_a_budget_of_its_own_or_share_one() -> None:
    """Six offloaders in one process drew from one budget, so the later ones copied to
    pageable memory; a HostBudget passed as pin_memory_budget is that offloader's alone,
    or the chosen ones' together."""
    own = offload(pin_memory_budget=HostBudget())
    other = offload(pin_memory_budget=HostBudget(1 << 20))
    assert own.pool.host_budget is not PROCESS_BUDGET and own.pool.budget == default_budget()
    assert other.pool.budget == 1 << 20
    shared = HostBudget(3 * 4096)
    a, b = offload(pin_memory_budget=shared), offload(pin_memory_budget=shared)
    assert a.pool.host_budget is b.pool.host_budget is shared
    with pytest.raises(ValueError, match=r"pin_memory_budget='1GB'"):
        offload(pin_memory_budget="1GB")
    with pytest.raises(ValueError, match=r"HostBudget\(limit=-1\)"):
        HostBudget(-1)


# --- blocks made between steps: no new block inside a forward after the first ------------------


def _news(ctx: leakfree.OffloadActivations) -> int:
    """Blocks the pool has made so far (in its budget or beyond it): read before and after
    a forward, those made inside it (as it sends its copies)."""
    stats = ctx.pool.stats
    return stats.allocations + stats.overflows


def test_later_forwards_make_no_host_block_inside_the_forward() -> None:
    """Restored tensors view their host blocks on the CPU, so every step's blocks leave the
    pool with its graph, and each forward made its blocks as it sent (cudaHostAlloc, which
    serialises the device, on an accelerator). The pool now makes them when a backward
    pass ends, for the step after. (The first forward sends each copy alone and plans the
    groups: the second, the first grouped, takes blocks of other sizes; from the third
    on, every forward of the plan finds its blocks made.)"""
    model, x = make()
    ctx = offload()
    made = []
    for _ in range(5):
        before = _news(ctx)
        with ctx:
            loss = model(x).square().mean()
        made.append(_news(ctx) - before)
        loss.backward()
    assert made[0] > 0 and made[2:] == [0, 0, 0], made
    stats = ctx.pool.stats
    assert stats.misses == made[0] + made[1]
    assert stats.ahead > 0 and stats.reuses >= 3 * made[2]  # made as a backward pass ended
    with ctx:
        loss = model(x).square().mean()
    assert ctx.pool.stats.step_misses == 0  # this step's, so far


def test_two_forwards_before_their_backwards_are_prepared_for_too() -> None:
    """Accumulation: two forwards, then two backward passes. The pass that ends with no
    forward since the last says nothing new: the blocks of both forwards are made."""
    model, x = make()
    ctx = offload()
    news = []
    for _ in range(4):
        before = _news(ctx)
        with ctx:
            first = model(x).square().mean()
        with ctx:
            second = model(x + 1).square().mean()
        news.append(_news(ctx) - before)
        first.backward()
        second.backward()
    assert news[0] > 0 and news[2:] == [0, 0], news


def test_a_slow_device_s_busy_blocks_are_reused_in_stream_order(sim: Any) -> None:
    """The host runs ahead of the device: when the next forward sends, the blocks the last
    backward copied back from are free but their copies may not have run. The pool made a
    new block for each (growing towards twice what a step needs); now it hands the busy
    one out and the copy out waits for it on the device: no new block, no host wait."""
    sim.lazy = True  # no copy is seen to complete before the host waits for it
    model, x = make()
    model, x = model.to("sim"), x.to("sim")
    ctx = leakfree.OffloadActivations(min_offload_size=256)
    news, syncs = [], []
    for _ in range(5):
        before = _news(ctx)
        sim.reset_syncs()
        with ctx:
            loss = model(x).square().mean()
        syncs.append(sum(sim.syncs.values()))
        news.append(_news(ctx) - before)
        loss.backward()
    sim.module.synchronize()
    sim.lazy = False
    assert news[0] > 0 and news[2:] == [0, 0, 0], news
    assert syncs == [0] * 5  # and the forwards never waited for the device


def test_a_busy_block_is_written_only_after_its_last_copy_back(sim: Any) -> None:
    """Backward on another stream, the next forward on the first, which waits for nothing
    of the other's: the block its copy back read is handed out again while that copy may
    still run, so the copy out into it waits for its event on the device (the sanitizer
    reports the race without that wait)."""
    from tests.test_streams import one_offloaded_tensor

    sim.lazy = True
    lin, x, size = one_offloaded_tensor(sim)
    ctx = leakfree.OffloadActivations(min_offload_size=size, device_budget=0)
    other = sim.module.Stream()
    sim.reset_syncs()
    for _ in range(3):
        with ctx:
            y = torch.nn.functional.gelu(lin(x)).sum()
        other.wait_stream(sim.module.current_stream())
        with sim.module.stream(other):
            y.backward()
    assert sum(sim.syncs.values()) == 0
    sim.module.synchronize()
    sim.lazy = False
    stats = ctx.pool.stats
    assert stats.allocations == 1 and stats.reuses == 2  # one block, busy when reused


def test_the_pool_never_holds_a_block_in_use() -> None:
    """What the pool makes ahead is free; a block a graph holds is the graph's alone."""
    model, x = make()
    ctx = offload()
    for _ in range(2):
        with ctx:
            loss = model(x).square().mean()
        loss.backward()
    pool = ctx.pool
    free = {id(b) for b in pool._free.values()}
    assert free and pool.stats.cached_bytes > 0 and pool.stats.in_use_bytes == 0
    with ctx:
        loss = model(x).square().mean()
    copies = [ref() for ref in ctx._backward.copies.refs.values()]
    held = {id(c.group.block) for c in copies if c is not None and c.group is not None}
    assert held and not held & {id(b) for b in pool._free.values()}
    assert held <= free  # the forward took exactly blocks made ahead
    loss.backward()


# --- pinned bytes counted until the host allocator gives them back -----------------------------


def test_freed_pinned_blocks_count_until_the_host_cache_is_released(sim: Any) -> None:
    """A freed pinned block stays pinned in PyTorch's caching host allocator until its
    cache is emptied; the budget took the bytes back at once, so a pool evicting size
    classes, or managers made anew, pinned more than the budget."""
    budget = HostBudget(3 * 4096)
    pool = HostBlockPool(budget, pin=True)
    blocks = [pool.acquire(4096), pool.acquire(4096)]
    for block in blocks:
        pool.release(block)
    del pool, blocks, block  # the pool dies with its cached blocks: still pinned
    assert budget.used == 2 * 4096 and budget.parked == 2 * 4096
    again = HostBlockPool(budget, pin=True)
    reused = again.acquire(4096)  # the host allocator hands out the cached bytes again
    assert reused.pooled and budget.used == 2 * 4096 and budget.parked == 4096
    big = again.acquire(8192)  # no room beside what is cached: the cache is given back
    assert big.pooled and budget.parked == 0 and budget.used == 4096 + 8192
    again.release(reused)
    del reused
    assert again.trim() == 4096  # trim gives the host cache back too
    assert budget.used == 8192 and budget.parked == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to release: no warning, no error
        release_host_cache()
    del big


def test_pageable_blocks_give_their_bytes_back_when_freed() -> None:
    """No host allocator caches pageable memory: freed, the bytes are back at once."""
    budget = HostBudget(2 * 4096)
    pool = HostBlockPool(budget, pin=False)
    block = pool.acquire(4096)
    pool.release(block)
    del block
    assert pool.trim() == 4096 and budget.used == 0 and budget.parked == 0


def test_evicted_pinned_blocks_stay_counted_until_released(sim: Any) -> None:
    """Shapes that change: the pool evicts another size class to make room. The evicted
    bytes are cached by the host allocator, so they are released before the new block
    is counted in their place."""
    budget = HostBudget(2 * 4096)
    pool = HostBlockPool(budget, pin=True)
    small = [pool.acquire(4096) for _ in range(2)]
    for block in small:
        pool.release(block)
    del small, block
    big = pool.acquire(8192)
    assert big.pooled and budget.used == 8192 and budget.parked == 0
    assert pool.stats.cached_bytes == 0 and pool.stats.pooled_bytes == 8192
    pool.release(big)
    del big
    assert pool.trim() == 8192 and budget.used == 0
