"""Accelerator code paths on the simulated device (``tests/simdev``), sanitizer on.

Every test here runs leakfree's real stream code: ``OffloadActivations`` with a side
stream, pinned pool blocks, events, ``record_stream`` and backward prefetch;
``LossLog.reduce`` on a device. The ``sim`` fixture attaches a stream sanitizer (PyTorch's
CUDA Sanitizer algorithm) to every launch: a missing wait, or memory freed or reused while
another stream may still use it, fails the test at teardown. Gradients are compared with
``torch.equal`` against plain PyTorch on the CPU (the device computes with CPU kernels).
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import leakfree
from leakfree.diagnostics import count_host_syncs
from leakfree.offload import OffloadWarning
from leakfree.offload.pool import _size_class
from tests._functions import raise_in_the_body
from tests.test_offload import (
    Model,
    assert_equal_grads,
    grouping,
    make,
    normed_pair,
    reference_grads,
)


def on_sim(seed: int = 0) -> tuple[Model, torch.Tensor]:
    model, x = make(seed)
    return model.to("sim"), x.to("sim")


def sim_grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.cpu() for p in model.parameters()]


def offload(**kw: Any) -> leakfree.OffloadActivations:
    kw.setdefault("min_offload_size", 256)
    ctx = leakfree.OffloadActivations(**kw)
    assert ctx.device is not None and ctx.device.type == "sim"
    return ctx


def side_stream_ids(sim: Any) -> set[int]:
    return {entry[1] for entry in sim.log if entry[0] == "record" and entry[1] != 0}


# --- the device itself: the sanitizer and the sync auditor can fail ---------------------------


def test_sanitizer_reports_an_unordered_read_and_accepts_the_ordered_one(sim: Any) -> None:
    side = sim.module.Stream()
    a = torch.ones(256, device="sim")
    with sim.module.stream(side):
        (a * 2).sum()  # reads a, written on the default stream: no wait
    assert len(sim.sanitizer.errors) == 1
    assert "aten::mul" in sim.sanitizer.report()
    sim.sanitizer.errors.clear()
    side.wait_stream(sim.module.current_stream())
    with sim.module.stream(side):
        b = a * 2
    sim.module.current_stream().wait_event(side.record_event())
    (b + 1).sum()
    b.record_stream(sim.module.current_stream())  # allocated on side, used here
    del b
    assert sim.sanitizer.errors == []


def test_sanitizer_reports_a_fresh_allocation_used_by_a_stream_not_ordered_after_it(
    sim: Any,
) -> None:
    """The caching allocator may hand a stream a block its earlier work still uses: another
    stream writing the new allocation must wait for the allocation stream first (the rule
    offload's prefetch follows: its buffers are the current stream's, written by the side
    stream after ``side.wait_stream(current)``)."""
    side = sim.module.Stream()
    torch.ones(256, device="sim").sum()  # the default stream has work in flight
    fresh = torch.empty(256, device="sim")  # allocated on the default stream
    with sim.module.stream(side):
        fresh.fill_(1.0)  # written by side, which never waited for the default stream
    assert "before that stream waited for the allocation stream" in sim.sanitizer.report()
    sim.sanitizer.errors.clear()
    other = torch.empty(256, device="sim")
    side.wait_stream(sim.module.current_stream())
    with sim.module.stream(side):
        other.fill_(1.0)
    sim.module.current_stream().wait_stream(side)
    assert sim.sanitizer.errors == []


def test_sanitizer_reports_a_free_without_record_stream(sim: Any) -> None:
    side = sim.module.Stream()
    for record in (False, True):
        a = torch.ones(256, device="sim")  # allocated on the default stream
        side.wait_stream(sim.module.current_stream())
        with sim.module.stream(side):
            host = torch.empty(256, pin_memory=True)
            host.copy_(a, non_blocking=True)
        if record:
            a.record_stream(side)
        del a  # the default stream may get this memory back while side still reads it
        assert len(sim.sanitizer.errors) == (0 if record else 1)
        if not record:
            assert "freed while stream" in sim.sanitizer.report()
        sim.sanitizer.errors.clear()


def test_sanitizer_tracks_pinned_blocks_across_streams(sim: Any) -> None:
    one, two = sim.module.Stream(), sim.module.Stream()
    host = torch.empty(256, pin_memory=True)
    src = torch.ones(256, device="sim")
    one.wait_stream(sim.module.current_stream())
    two.wait_stream(sim.module.current_stream())
    with sim.module.stream(one):
        host.copy_(src, non_blocking=True)
        done = one.record_event()
    with sim.module.stream(two):
        host.copy_(src, non_blocking=True)  # the block reused before one's copy completed
    assert len(sim.sanitizer.errors) == 1
    sim.sanitizer.errors.clear()
    done.synchronize()
    with sim.module.stream(two):
        host.copy_(src, non_blocking=True)
    sim.module.current_stream().wait_stream(two)  # before src, read by both, is freed
    sim.module.current_stream().wait_stream(one)
    del src
    assert sim.sanitizer.errors == []


def test_auditor_counts_what_blocks_the_host(sim: Any) -> None:
    d = torch.arange(8.0, device="sim")
    pinned = torch.empty(8, pin_memory=True)
    pageable = torch.empty(8)
    cases: list[tuple[str, Any, set[str]]] = [
        ("to pageable", lambda: pageable.copy_(d, non_blocking=True), {"device_to_host"}),
        ("to pinned, blocking", lambda: pinned.copy_(d), {"device_to_host"}),
        ("to pinned, non_blocking", lambda: pinned.copy_(d, non_blocking=True), set()),
        ("from pageable", lambda: d.copy_(pageable, non_blocking=True), {"host_to_device"}),
        ("from pinned, blocking", lambda: d.copy_(pinned), {"host_to_device"}),
        ("from pinned, non_blocking", lambda: d.copy_(pinned, non_blocking=True), set()),
        ("torch.tensor(device=)", lambda: torch.tensor([1.0], device="sim"), {"host_to_device"}),
        ("item", lambda: d.sum().item(), {"_local_scalar_dense"}),
        ("nonzero", lambda: d.nonzero(), {"data_dependent:nonzero"}),
        ("mask", lambda: d[d > 2], {"data_dependent:index"}),
        ("synchronize", lambda: sim.module.synchronize(), {"synchronize"}),
        (
            "event",
            lambda: sim.module.current_stream().record_event().synchronize(),
            {"Event.synchronize"},
        ),
        ("compute", lambda: (d * 2).relu_().sum(), set()),
    ]
    for name, run, expect in cases:
        sim.reset_syncs()
        run()
        assert set(sim.syncs) == expect, name
        assert all(n == 1 for n in sim.syncs.values()), (name, sim.syncs)


def test_leakfree_sync_counter_agrees_with_the_device(sim: Any) -> None:
    d = torch.arange(8.0, device="sim")
    pinned = torch.empty(8, pin_memory=True)
    steps: list[Any] = [
        lambda: d.sum().item(),
        lambda: d.cpu(),
        lambda: pinned.copy_(d, non_blocking=True),
        lambda: d.copy_(pinned, non_blocking=True),
        lambda: d.copy_(torch.ones(8)),
        lambda: d.nonzero(),
        lambda: sim.module.synchronize(),
        lambda: (d * 2).sum(),
    ]
    for step in steps:
        sim.reset_syncs()
        with count_host_syncs() as counter:
            step()
        assert counter.count == sum(sim.syncs.values()), (counter.ops, sim.syncs)


# --- OffloadActivations with streams: every scenario, bit-identical, no race -----------------


def test_forward_never_waits_and_gradients_are_bit_identical(sim: Any) -> None:
    model, x = on_sim()
    ctx = offload()
    assert ctx.use_streams and ctx.use_pin_memory
    sim.reset_syncs()
    with count_host_syncs() as counter, ctx:
        loss = model(x).square().mean()
    assert dict(sim.syncs) == {} and counter.count == 0
    stats = ctx.pool.stats
    assert stats.in_use_bytes > 0 and stats.overflows == 0  # pinned, pooled blocks
    assert len(side_stream_ids(sim)) == 1  # the copies ran on one side stream
    loss.backward()
    assert_equal_grads(sim_grads(model), reference_grads())
    assert ctx.pool.stats.in_use_bytes == 0


def test_two_with_blocks_then_one_backward(sim: Any) -> None:
    model, x = on_sim()
    ctx = offload()
    with ctx:
        loss1 = model(x).square().mean()
    with ctx:
        loss2 = model(x * 2).square().mean()
    assert 2 <= ctx.stats.groups < ctx.stats.to_host  # a group each, of several copies
    (loss1 + loss2).backward()
    assert ctx.stats.to_device == ctx.stats.groups  # one pass over both: once each
    ref, xr = make()
    (ref(xr).square().mean() + ref(xr * 2).square().mean()).backward()
    assert_equal_grads(sim_grads(model), [p.grad for p in ref.parameters()])
    assert ctx.pool.stats.in_use_bytes == 0


def test_retain_graph_twice(sim: Any) -> None:
    model, x = on_sim()
    ctx = offload()
    with ctx:
        loss = model(x).square().mean()
    loss.backward(retain_graph=True)
    assert ctx.stats.to_device == ctx.stats.groups  # once each per pass
    first = sim_grads(model)
    model.zero_grad()
    loss.backward()
    assert ctx.stats.to_device == 2 * ctx.stats.groups
    assert_equal_grads(first, sim_grads(model))
    assert_equal_grads(first, reference_grads())


def test_double_backward(sim: Any) -> None:
    results = []
    for ctx in (leakfree.NoOffload(), offload(min_offload_size=1)):
        x = torch.linspace(-1, 1, 64, device="sim", requires_grad=True)
        with ctx:
            y = (torch.tanh(x) * torch.sigmoid(x) * x.exp()).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
        results.append((g.detach().cpu(), gg.cpu()))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_a_second_backward_on_another_stream_shares_the_restored_storage(sim: Any) -> None:
    """A storage restored by one backward and still alive (the double-backward graph keeps
    it) is shared with the handles a second backward unpacks, here on another stream:
    that stream must wait for the copy-in, and be recorded on the storage."""
    x = torch.linspace(-1, 1, 256, device="sim", requires_grad=True)
    ctx = offload(min_offload_size=1)
    with ctx:
        h = x * 3.0
        y = (h * h).sum() + torch.tanh(h).sum()  # h saved twice by mul; tanh its output
    (g,) = torch.autograd.grad(y, x, create_graph=True)  # restores h; g's graph keeps it
    other = sim.module.Stream()  # waits for nothing: all it reads comes from the offload
    with sim.module.stream(other):
        (again,) = torch.autograd.grad(y, x, retain_graph=True)  # no host wait after it
    (gg,) = torch.autograd.grad(g.sum(), x)
    gg, g_host = gg.cpu(), g.detach().cpu()
    del g  # frees the shared storage, last read by `other`: record_stream covers it
    sim.module.current_stream().wait_stream(other)
    again = again.cpu()
    xr = torch.linspace(-1, 1, 256, requires_grad=True)
    hr = xr * 3.0
    yr = (hr * hr).sum() + torch.tanh(hr).sum()
    (gr,) = torch.autograd.grad(yr, xr, create_graph=True)
    (ggr,) = torch.autograd.grad(gr.sum(), xr)
    assert torch.equal(g_host, gr.detach()) and torch.equal(again, gr.detach())
    assert torch.equal(gg, ggr)


def test_views_and_shared_storages(sim: Any) -> None:
    ctx = offload(min_offload_size=1)
    base = torch.randn(64, 64, device="sim", requires_grad=True)
    big = torch.randn(1024, 64, device="sim")
    w = torch.randn(64, device="sim", requires_grad=True)
    with ctx:
        a = base * 1.0
        v1, v2, v3 = a[:32], a.t(), a.view(-1)
        out = (v1 * v1).sum() + (v2 * v2).sum() + (v3 * v3).sum()
        out = out + (big[3:5] * w).sum()  # a 2x64 span of a 256 KiB storage
    stats = ctx.pool.stats
    assert stats.allocations == 2  # the three views share one copy; the span its own
    assert stats.in_use_bytes == _size_class(64 * 64 * 4) + _size_class(2 * 64 * 4)
    out.backward()
    ad = a.detach().cpu()
    expect = 2 * ad
    expect[:32] += 2 * ad[:32]
    expect += 2 * ad
    assert torch.equal(base.grad.cpu(), expect)
    assert torch.equal(w.grad.cpu(), big[3:5].cpu().sum(0))


def deep(width: int = 64, depth: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def _watch_prefetch(ctx: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int]]:
    """Bytes outstanding after each look-ahead, and the size of each prefetched copy."""
    outstanding: list[int] = []
    prefetched: list[int] = []
    import leakfree.offload.backward as hooks

    plan = hooks._to_prefetch

    def watched(state: Any, current: Any, window: int) -> list[Any]:
        out = plan(state, current, window)
        outstanding.append(state.outstanding)
        prefetched.extend(c.used for c in out)
        return out

    monkeypatch.setattr(hooks, "_to_prefetch", watched)
    return outstanding, prefetched


@pytest.mark.parametrize(("stash", "window"), [(5, 16 * 1024), (1, 24 * 1024)])
def test_prefetch_follows_the_order_backward_used_within_a_byte_window(
    sim: Any, monkeypatch: pytest.MonkeyPatch, stash: int, window: int
) -> None:
    """The first backward prefetches nothing (nothing learned: nothing is brought back
    that backward will not use); the next one of the same shape follows the order the
    first used, within ``prefetch_bytes``, and every copy comes back once (each copy is
    a group of its own here: ``batch_bytes=0``)."""
    model, x = deep().to("sim"), torch.randn(32, 64, device="sim")  # 8 KiB activations
    ctx = offload(max_fwd_stash_size=stash, prefetch_bytes=window, batch_bytes=0)
    outstanding, prefetched = _watch_prefetch(ctx, monkeypatch)
    for step in range(3):
        model.zero_grad()
        sim.reset_copies()
        with ctx:
            loss = model(x).square().mean()
        loss.backward()
        if step == 0:
            assert prefetched == []
        assert sim.copies["to_device"] == sim.copies["to_host"] > 0  # back once each
    assert len(prefetched) >= 2 * 10  # steps 2 and 3: most copies came back ahead of use
    assert max(outstanding) <= window and max(outstanding) > window - 8 * 1024
    assert ctx.stats.to_device == ctx.stats.to_host  # one copy back per copy out
    ref = deep()
    ref(x.cpu()).square().mean().backward()
    assert_equal_grads(sim_grads(model), [p.grad for p in ref.parameters()])


def test_prefetch_bytes_zero_copies_back_only_on_demand(
    sim: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, x = deep().to("sim"), torch.randn(32, 64, device="sim")
    ctx = offload(prefetch_bytes=0)
    _, prefetched = _watch_prefetch(ctx, monkeypatch)
    for _ in range(2):
        model.zero_grad()
        with ctx:
            loss = model(x).square().mean()
        loss.backward()
    assert prefetched == [] and ctx.stats.to_device == ctx.stats.groups > 0
    ref = deep()
    ref(x.cpu()).square().mean().backward()
    assert_equal_grads(sim_grads(model), [p.grad for p in ref.parameters()])


def _group_sizes(ctx: Any) -> list[int]:
    """The bytes each live group of ``ctx``'s copies holds."""
    groups = {}
    for ref in ctx._backward.copies.refs.values():
        copy = ref()
        if copy is not None and copy.group is not None:
            groups[id(copy.group)] = copy.group.used
    return list(groups.values())


@pytest.mark.parametrize("batch_bytes", [0, 32 * 1024, 256 * 1024])
def test_small_copies_go_out_and_come_back_in_groups(
    sim: Any, monkeypatch: pytest.MonkeyPatch, batch_bytes: int
) -> None:
    """Each copy out is one copy on the side stream into its group's block; each group
    comes back in one copy to one device allocation, prefetched or not; a block is the
    size class of what its group holds. The first forward sends every copy alone (as
    batch_bytes=0 always does); the next ones group up to batch_bytes, at most an eighth
    of what the first moved (here 63 KiB: 32 KiB groups are not held to it, the 256 KiB
    default is)."""
    model = deep(depth=32).to("sim")
    x = torch.randn(32, 64, device="sim")  # 8 KiB activations, 65 saved
    ctx = offload(batch_bytes=batch_bytes)
    _, prefetched = _watch_prefetch(ctx, monkeypatch)
    # the third backward prefetches, whole groups (the second follows the order the first
    # used only if the plan made after the first forward left its groups as they were)
    ref = deep(depth=32)
    ref(x.cpu()).square().mean().backward()
    expected = [p.grad for p in ref.parameters()]  # the same every step: no optimizer
    for step in range(3):
        model.zero_grad()
        sim.reset_copies()
        before = dataclasses.replace(ctx.stats)
        with ctx:
            loss = model(x).square().mean()
        out, groups = ctx.stats.to_host - before.to_host, ctx.stats.groups - before.groups
        sizes = _group_sizes(ctx)
        assert sum(map(_size_class, sizes)) == ctx.pool.stats.in_use_bytes
        assert sim.copies["to_host"] == out > 0
        if batch_bytes == 0 or step == 0:
            assert groups == out
        else:  # as few as fit: every group but the last is too full for the next copy
            assert ctx._planner.capacity == min(batch_bytes, 63 * 8 * 1024 // 8)  # 63 moved, 2 kept
            per_group = ctx._planner.capacity // (8 * 1024)  # whole copies
            assert groups == -(-out // per_group) < out
        loss.backward()
        assert sim.copies["to_device"] == ctx.stats.to_device - before.to_device == groups
        if step == 2:
            assert bool(prefetched) == (groups > 1)
        assert set(prefetched) <= set(sizes)
        assert_equal_grads(sim_grads(model), expected)
    assert ctx.pool.stats.in_use_bytes == 0


def test_a_group_leaves_the_device_when_its_last_handle_is_unpacked(sim: Any) -> None:
    """Within a pass, a group's device tensor (and the views of it handed out) is let go
    as soon as the last handle of its copies has been unpacked, not when the pass ends:
    when the input's gradient is reached, every group has been used for the last time."""
    model = deep(depth=6).to("sim")
    x = torch.randn(32, 64, device="sim", requires_grad=True)
    ctx = offload(batch_bytes=24 * 1024)  # three 8 KiB copies a group
    with ctx:
        loss = model(x).square().mean()
    copies = (r() for r in ctx._backward.copies.refs.values())
    groups = {id(c.group): c.group for c in copies if c and c.group}
    assert len(groups) >= 3
    alive: list[int] = []

    def at_the_input(grad: torch.Tensor) -> None:  # still inside the pass
        alive.extend(i for i, g in enumerate(groups.values()) if g.keep is not None or g.views)
        alive.extend(
            100 + i
            for i, g in enumerate(groups.values())
            if g.restored is not None and g.restored[0]() is not None
        )

    x.register_hook(at_the_input)
    loss.backward()
    assert alive == []
    assert ctx.stats.to_device == len(groups)


class Views(nn.Module):
    """Saved views of one storage needed by several backward nodes, at different times (a
    fused projection split into q, k, v, as attention does)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(64, 192)
        self.out = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(64, dim=-1)
        h = self.out(q * k + v.sin())  # mul saves q and k; sin saves v
        return (h * q.cos()).square().mean()  # cos saves q again, used first in backward


@pytest.mark.parametrize("batch_bytes", [0, 256 << 10], ids=["alone", "grouped"])
def test_views_needed_by_several_nodes_come_back_once_per_pass(sim: Any, batch_bytes: int) -> None:
    """Each group of copies comes back at most once per backward pass: its restored
    storage is kept until the last node that needs it has unpacked it (before, the first
    node's restored copy died with its saved tensors and the next node copied the bytes
    again). Alone, each copy is a group; grouped, all of them are one."""
    torch.manual_seed(0)
    model, x = Views().to("sim"), torch.randn(32, 64, device="sim")
    ctx = grouping(offload(batch_bytes=batch_bytes))
    sim.reset_copies()  # the model's and the input's uploads are not the offloader's
    with ctx:
        loss = model(x)
    out, groups = sim.copies["to_host"], ctx.stats.groups
    assert groups == (out if batch_bytes == 0 else 1)
    loss.backward(retain_graph=True)
    assert sim.copies["to_device"] == groups  # the qkv storage: once, not once per node
    loss.backward()
    assert sim.copies["to_device"] == 2 * groups  # a second pass: once more, each
    assert (ctx.stats.to_host, ctx.stats.to_device) == (out, 2 * groups)
    torch.manual_seed(0)
    ref, xc = Views(), x.cpu()
    ref(xc).backward(retain_graph=True)
    ref(xc).backward()
    assert_equal_grads(sim_grads(model), [p.grad for p in ref.parameters()])


def test_small_storages_stay_on_the_device_and_never_cross(sim: Any) -> None:
    """After the first step the norms' per-row statistics (256 B each) stay on the device:
    the device counts the copies each way, and gradients match the CPU bit for bit."""
    model, plain = normed_pair()
    model.to("sim")
    ctx = offload(min_offload_size=1)
    ctx.update_model_params(model)
    x = torch.randn(64, 256)
    on_device = x.to("sim")
    crossed = []
    for _ in range(3):
        sim.reset_copies()
        with ctx:
            loss = model(on_device)
        model.zero_grad()
        loss.backward()
        crossed.append((sim.copies["to_host"], sim.copies["to_host_bytes"] % (64 * 1024)))
        assert sim.copies["to_device_bytes"] == sim.copies["to_host_bytes"]
        plain.zero_grad()
        plain(x).backward()
        assert_equal_grads(sim_grads(model), [p.grad for p in plain.parameters()])
    plan = ctx.plan
    assert plan is not None and plan.small == 9
    # the first step moves the nine statistics and the first row; later steps the row
    # and whole activations only
    assert crossed[0] == (20, 9 * 256 + 1024) and crossed[1] == crossed[2] == (9, 1024)


def test_in_flight_window_frees_activations_while_their_copies_run(sim: Any) -> None:
    """Activations leave the in-flight window (and die) inside the with-block, while their
    copies may still be reading them on the side stream: record_stream must cover that."""
    model, x = deep(width=128, depth=12).to("sim"), torch.randn(64, 128, device="sim")
    ctx = offload(max_fwd_stash_size=1)
    with ctx:
        loss = model(x).square().mean()
        peak_window = len(ctx._transfers.in_flight)
    assert peak_window <= 1
    loss.backward()
    ref = deep(width=128, depth=12)
    ref(x.cpu()).square().mean().backward()
    assert_equal_grads(sim_grads(model), [p.grad for p in ref.parameters()])


def test_forward_without_backward_frees_everything(sim: Any) -> None:
    model, x = on_sim()
    before = sim.allocated()
    ctx = offload()
    with ctx:
        loss = model(x).square().mean()
        del loss  # the graph dies inside the block, copies possibly still in flight
    assert ctx.pool.stats.in_use_bytes == 0
    assert sim.allocated() == before


def test_pool_reuse_across_steps(sim: Any) -> None:
    model, x = on_sim()
    ctx = offload(device_budget=0)  # every step moves everything: the pool's reuse is seen
    for _step in range(3):
        model.zero_grad()
        with ctx:
            loss = model(x).square().mean()
        loss.backward()
        assert_equal_grads(sim_grads(model), reference_grads())
    stats = ctx.pool.stats
    assert stats.reuses >= 2 * stats.allocations and stats.in_use_bytes == 0


def one_offloaded_tensor(sim: Any) -> tuple[nn.Linear, torch.Tensor, int]:
    """A layer whose forward offloads exactly one tensor (its 4 KiB output, saved by gelu;
    the 2 KiB input stays), and that tensor's size."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 64).to("sim")
    x = torch.randn(16, 32, device="sim", requires_grad=True)
    return lin, x, 16 * 64 * 4


def test_a_slow_device_s_busy_block_is_reused_in_stream_order(sim: Any) -> None:
    """A block whose last copy back has not completed is handed out again all the same
    (no room for a new one, and none needed): the copy out waits for it on the device,
    and the host never waits (the sanitizer reports the copy out if it did not wait)."""
    sim.lazy = True
    lin, x, size = one_offloaded_tensor(sim)
    ctx = offload(min_offload_size=size, pin_memory_budget=_size_class(size), device_budget=0)
    for _ in range(2):
        with ctx:
            y = nn.functional.gelu(lin(x)).sum()
        y.backward()
    stats = ctx.pool.stats
    assert stats.allocations == 1 and stats.reuses == 1 and stats.overflows == 0
    assert sim.syncs["Event.synchronize"] == 0
    expect = x.grad.cpu() / 2
    x.grad = None
    nn.functional.gelu(lin(x)).sum().backward()
    assert torch.equal(x.grad.cpu(), expect)


@pytest.mark.parametrize("lazy", [False, True], ids=["fast", "slow"])
def test_a_block_moves_between_streams_only_after_its_last_copy(sim: Any, lazy: bool) -> None:
    """Without side streams, copies run on the current stream: a block last used on one
    stream is handed to a copy on another only once that use has completed (the pool
    asks the block's event, or waits for it when there is no room for another block).
    The streams do not wait for each other: only the pool's care orders them."""
    sim.lazy = lazy
    lin, x, size = one_offloaded_tensor(sim)
    ctx = offload(
        use_streams=False,
        min_offload_size=size,
        pin_memory_budget=_size_class(size),
        device_budget=0,  # a copy every time
    )
    one, two = sim.module.Stream(), sim.module.Stream()
    for stream in (one, two):
        stream.wait_stream(sim.module.current_stream())  # for lin and x, made here
    grads = []
    for stream, backward in ((one, False), (two, True), (one, True)):
        with sim.module.stream(stream):
            with ctx:
                y = nn.functional.gelu(lin(x)).sum()
            if backward:  # else the graph is dropped with its copy out possibly running
                (g,) = torch.autograd.grad(y, x)  # kept on the device: a read-back would
                grads.append(g)  # make the host wait, ordering everything after it
            del y
    for stream in (one, two):
        sim.module.current_stream().wait_stream(stream)
    stats = ctx.pool.stats
    assert stats.allocations == 1 and stats.reuses == 2 and stats.overflows == 0
    nn.functional.gelu(lin(x)).sum().backward()
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], x.grad)
    for stream in (one, two):  # the grads, made there and read here, are freed after this
        stream.wait_stream(sim.module.current_stream())


def test_pool_evicts_and_overflows_under_a_small_budget(sim: Any) -> None:
    model, x = on_sim()
    ctx = offload(pin_memory_budget=64 * 1024)
    with pytest.warns(OffloadWarning, match="budget"), ctx:
        loss = model(x).square().mean()
    stats = ctx.pool.stats
    assert stats.overflows > 0 and stats.pooled_bytes <= 64 * 1024
    loss.backward()
    assert_equal_grads(sim_grads(model), reference_grads())
    assert ctx.pool.stats.in_use_bytes == 0


class FailOnce(torch.autograd.Function):
    armed = True

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        if FailOnce.armed:
            FailOnce.armed = False
            raise RuntimeError("backward failed")
        return g


def settled(pool: Any, timeout: float = 30.0) -> bool:
    """Whether ``pool`` has no block in use within ``timeout`` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while pool.stats.in_use_bytes:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def fail_a_backward(ctx: Any, model: nn.Module, x: torch.Tensor) -> None:
    """One step under ``ctx`` whose backward raises; its graph is dropped after."""
    FailOnce.armed = True
    with ctx:
        loss = FailOnce.apply(model(x)).square().mean()
    with pytest.raises(RuntimeError, match="backward failed"):
        loss.backward()


def test_a_failed_backward_s_blocks_wait_on_the_engine_not_the_pool(sim: Any) -> None:
    """Proof of where the bytes of a failed backward wait: nothing on this thread touches
    the pool after the exception, yet in-use bytes reach 0 (autograd's device worker drops
    the graph). Without it, this loop would time out."""
    model, x = on_sim()
    ctx = offload()
    for _ in range(5):
        fail_a_backward(ctx, model, x)
        assert settled(ctx.pool), ctx.pool.stats
        assert ctx.pool.stats.cached_bytes == ctx.pool.stats.pooled_bytes  # all reusable


def test_exceptions_in_the_body_and_in_backward(sim: Any) -> None:
    model, x = on_sim()
    ctx = offload()
    raise_in_the_body(ctx, model, x)
    assert ctx.pool.stats.in_use_bytes == 0
    fail_a_backward(ctx, model, x)
    # The failed backward's graph leaves nothing, but not at once: autograd's device worker
    # thread drops the graph's queued nodes a moment after the exception reaches this
    # thread (measured: about 1 ms later, longer on a loaded machine). The pool counts the
    # blocks free as soon as the graph goes; wait for that, bounded.
    assert settled(ctx.pool), ctx.pool.stats
    model.zero_grad()
    with ctx:
        loss = FailOnce.apply(model(x)).square().mean()
    loss.backward()
    assert_equal_grads(sim_grads(model), reference_grads())


def test_checkpointing(sim: Any) -> None:
    from torch.utils.checkpoint import checkpoint

    model, x = on_sim()
    ctx = offload()
    with ctx:
        h = x
        for block in model.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        loss = model.lm_head(h).square().mean()
    loss.backward()
    assert 0 < ctx.stats.to_device <= ctx.stats.to_host  # the checkpoints' inputs, once
    assert_equal_grads(sim_grads(model), reference_grads())


def test_a_partial_pass_frees_what_it_kept_when_it_ends(sim: Any) -> None:
    """A storage kept for handles a pass never reaches (``autograd.grad`` of an inner
    tensor) is dropped when the pass ends, not held until the graph dies."""
    torch.manual_seed(0)
    model, x = Views().to("sim"), torch.randn(32, 64, device="sim", requires_grad=True)
    ctx = offload()
    with ctx:
        q, k, v = model.qkv(x).split(64, dim=-1)
        inner = q * k  # saves q and k: views of the qkv storage
        loss = (model.out(inner + v.sin()) * q.cos()).square().mean()
    torch.autograd.grad(inner.sum(), x, retain_graph=True)  # reaches mul only, not sin/cos
    copies = [r() for r in ctx._backward.copies.refs.values()]
    kept = [c.group.keep for c in copies if c is not None and c.group is not None]
    assert kept  # the qkv storage's group, at least
    kept = [k for k in kept if k is not None]
    del copies
    assert kept == []  # the pass ended: its keep is gone, though sin and cos never ran
    assert not ctx._backward._passes
    loss.backward()


def test_backward_after_the_manager_is_gone(sim: Any) -> None:
    """Dropping the manager leaves the graph its host copies; backward restores them with
    plain copies on the compute stream, after the side stream's copies out."""
    model, x = on_sim()
    ctx = offload()
    with ctx:
        loss = model(x).square().mean()
    ref = weakref.ref(ctx)
    del ctx
    assert ref() is None
    loss.backward()
    assert_equal_grads(sim_grads(model), reference_grads())


# --- LossLog on a device ----------------------------------------------------------------------


def test_losslog_reduce_on_the_device_same_floats_one_wait(sim: Any) -> None:
    keys = {"a": "mean", "b": "min", "c": "max", "d": "sum"}
    results = []
    for device in ("cpu", "sim"):
        log = leakfree.LossLog(keys, device=device)
        for i in range(100):
            for key in "abc":
                log[key].append(torch.full((), i / 7, device=device))
        log["d"].append(2.5)
        sim.reset_syncs()
        with count_host_syncs() as counter:
            results.append(log.reduce())
        if device == "sim":
            assert sum(sim.syncs.values()) == 1 and counter.count == 1, sim.syncs
    assert results[0] == results[1]


# --- the GPU suite cannot rot: its tiny sizes run here, on the simulated device ---------------


# --- a device byte budget -----------------------------------------------------------------


def _budget_run(sim: Any, budget: int | None, batches: tuple[int, ...] = (32, 32, 32)) -> Any:
    """Steps of the deep MLP under ``OffloadActivations(device_budget=budget)``: per step,
    the bytes it held on the device at most, moved to the host and back, and the device
    peak of the forward; then the gradients against the CPU."""
    model, ref = deep(depth=16).to("sim"), deep(depth=16)
    ctx = offload(device_budget=budget)
    steps = []
    for batch in batches:
        x = torch.randn(batch, 64, device="sim")
        model.zero_grad()
        before = dataclasses.replace(ctx.stats)
        ctx.stats.peak_held_bytes = 0
        sim.reset_peak()
        with ctx:
            loss = model(x).square().mean()
        peak = sim.peak()
        loss.backward()
        steps.append(
            {
                "held": ctx.stats.peak_held_bytes,
                "to_host": ctx.stats.to_host_bytes - before.to_host_bytes,
                "to_device": ctx.stats.to_device_bytes - before.to_device_bytes,
                "peak": peak,
            }
        )
        ref.zero_grad()
        ref(x.cpu()).square().mean().backward()
        assert_equal_grads(sim_grads(model), [p.grad for p in ref.parameters()])
    return ctx, steps


def test_a_device_budget_keeps_the_last_activations_and_moves_the_rest(sim: Any) -> None:
    budget = 96 * 1024  # 12 of the 32 activations of 8 KiB
    ctx, steps = _budget_run(sim, budget)
    _, everything = _budget_run(sim, 0)
    plan = ctx.plan
    assert plan is not None and plan.budget == budget and plan.replans == 0
    total = plan.kept_bytes + plan.moved_bytes
    assert plan.kept_bytes <= budget and plan.kept_bytes > budget - 8 * 1024
    assert total == everything[0]["to_host"]  # the same copies, by storage
    for step in steps:
        assert step["held"] <= budget  # the first step too: it holds, then moves the oldest
        assert step["to_host"] <= 1.05 * (total - budget)
        assert step["to_device"] == step["to_host"]  # what moved comes back, once
        # the device memory the budget adds over moving everything is the budget at most
        assert step["peak"] <= everything[0]["peak"] + budget + 512  # a block's rounding
    assert "stay on the device" in str(plan)


def test_a_budget_that_keeps_everything_moves_nothing(sim: Any) -> None:
    ctx, steps = _budget_run(sim, 10 * 2**20)
    assert all(s["to_host"] == s["to_device"] == 0 for s in steps)
    assert ctx.plan is not None and ctx.plan.moved == 0 and ctx.stats.to_host == 0
    assert ctx.pool.stats.allocations == 0


def test_a_zero_budget_moves_everything(sim: Any) -> None:
    ctx, steps = _budget_run(sim, 0)
    _, everything = _budget_run(sim, 0)
    assert [s["to_host"] for s in steps] == [s["to_host"] for s in everything]
    assert all(s["held"] == 0 for s in steps[1:])  # planned: moved as the forward goes


def test_a_budget_follows_its_plan_by_place_across_lengths_and_holds_its_bytes(
    sim: Any,
) -> None:
    """A forward of other lengths saves as many tensors: it follows the plan by place (the
    same ones move), and the budget's bytes still bound what it holds (in a longer one,
    the oldest held move too)."""
    budget = 64 * 1024
    ctx, steps = _budget_run(sim, budget, batches=(32, 32, 16, 16, 64, 32))
    assert ctx.plan is not None and ctx.plan.replans == 0
    assert all(s["held"] <= budget for s in steps)
    assert steps[2]["to_host"] < steps[1]["to_host"] < steps[4]["to_host"]


def test_offload_model_takes_a_device_budget(sim: Any) -> None:
    model, x = on_sim()
    ctx = leakfree.offload_model(model, device_budget=0, min_offload_size=256)
    with ctx:
        loss = model(x).square().mean()
    loss.backward()
    assert ctx.device_budget == 0 and ctx.plan is not None and ctx.plan.moved > 0
    assert_equal_grads(sim_grads(model), reference_grads())
    leakfree.remove_offload_hooks(model)


@pytest.mark.parametrize("lazy", [False, True], ids=["copies done", "copies pending"])
def test_the_in_flight_window_records_a_stream_only_for_copies_still_running(
    sim: Any, lazy: bool
) -> None:
    """A tensor leaves the window as it is when its copy out is done (the common case). One
    that leaves mid-forward while its copy runs goes in stream order (the compute stream
    waits for the copy: no record_stream, its memory reusable at once); the ones left at
    ``__exit__`` are recorded on the side stream, so backward need not wait. The window,
    not the handle, holds them, so a graph dropped mid-forward cannot free what a copy
    reads."""
    model, x = deep(depth=8).to("sim"), torch.randn(32, 64, device="sim")
    sim.lazy = lazy
    ctx = offload(max_fwd_stash_size=2, batch_bytes=0)  # each copy sent as it is made
    with ctx:
        loss = model(x).square().mean()
        held = [weakref.ref(t) for t, _, _ in ctx._transfers.in_flight]
        del loss  # the graph dies mid-forward: its handles go, the window's tensors stay
        assert len(held) == 2 and all(r() is not None for r in held)
    recorded = [e for e in sim.log if e[0] == "record_stream"]
    assert len(recorded) == (2 if lazy else 0)  # the two left at __exit__, copies pending
    assert all(r() is None for r in held)  # let go at __exit__
    sim.lazy = False


def test_the_window_lets_tensors_go_in_stream_order_in_every_mode(sim: Any) -> None:
    """Whatever the mode, a moved tensor stays in the window while its copy runs; once the
    window is full the oldest goes in stream order (the compute stream waits for its
    copy, no ``record_stream``), so what the device holds for copies in flight is the
    window at most: a budget's moved tensors, let go at once with ``record_stream``
    before, were held by the allocator until the host saw their copies end."""
    model, x = deep(depth=8).to("sim"), torch.randn(32, 64, device="sim")
    sim.lazy = True  # the host never sees a copy end before it waits: the worst case
    ctx = offload(batch_bytes=0)
    for budget in (None, 0):
        ctx.device_budget = budget
        sim.log.clear()
        before = ctx.stats.to_host
        with ctx:
            loss = model(x).square().mean()
            window = len(ctx._transfers.in_flight)
        moved = ctx.stats.to_host - before
        loss.backward()
        out = {
            side.stream_id for (_, back), side in ctx._transfers.side_streams.items() if not back
        }
        recorded = [e for e in sim.log if e[0] == "record_stream" and e[2] in out]
        assert moved > 5 and window == ctx.max_fwd_stash_size == 5
        assert len(recorded) == window  # only the window's, at __exit__
    sim.lazy = False


def test_a_copy_back_on_a_stream_that_never_saw_the_copies_out_waits_for_them(
    sim: Any,
) -> None:
    """A backward on a stream ordered after the forward's compute, but not after its side
    stream, reads host blocks the side stream wrote: each copy back waits for its copy
    out's event first (no prefetch in a first pass, so every copy back is on demand)."""
    model, x = on_sim()
    ctx = offload(min_offload_size=1)  # nothing kept: the test's own tensors cross no stream
    other = sim.module.Stream()
    with ctx:
        loss = model(x).square().mean()
        forward_done = sim.module.current_stream().record_event()  # before __exit__
    other.wait_event(forward_done)  # the compute of the forward, not its copies out
    with sim.module.stream(other):
        loss.backward()
        grads = sim_grads(model)
    sim.module.current_stream().wait_stream(other)
    assert_equal_grads(grads, reference_grads())


def test_the_pool_never_evicts_a_block_a_copy_still_reads(sim: Any) -> None:
    """Making room for another size class frees only cached blocks whose last copy has
    completed; on a slow device the busy one stays, and the new block overflows."""
    from leakfree.offload.pool import HostBlockPool

    sim.lazy = True
    pool = HostBlockPool(budget=8192, pin=True)
    small = pool.acquire(4096)
    small.event = sim.module.current_stream().record_event()  # a copy still reads it
    pool.release(small)
    with pytest.warns(OffloadWarning, match="budget"):
        big = pool.acquire(8192)  # needs small's room: small is busy, so no eviction
    assert pool.stats.overflows == 1 and pool.stats.cached_bytes == 4096
    pool.release(big)
    sim.lazy = False


def test_a_plan_that_keeps_everything_makes_no_copy_objects_and_still_holds_the_budget(
    sim: Any,
) -> None:
    """Once a forward fits the budget whole, the next ones keep their saved tensors as they
    are (no copy, no handle machinery: what "costs nothing over no offloading" takes);
    a forward that outgrows it, or a second forward before backward, is held to the budget
    all the same, counting what the first kept."""
    model = deep(depth=16).to("sim")
    budget = 200 * 1024  # the batch-32 forward's 264 KiB does not fit; batch 16's does
    ctx = offload(device_budget=budget)
    small = torch.randn(16, 64, device="sim")
    for _ in range(2):
        with ctx:
            loss = model(small).square().mean()
        loss.backward()
    made = ctx._backward.copies.next_seq()
    ctx.stats.peak_held_bytes = 0
    with ctx:
        loss = model(small).square().mean()
    assert ctx._backward.copies.next_seq() == made and ctx.stats.to_host == 0  # no copy at all
    large = torch.randn(32, 64, device="sim")
    with ctx:  # a second forward before the first's backward, twice as big
        big = model(large).square().mean()
    assert 0 < ctx.stats.peak_held_bytes <= budget
    assert ctx.stats.to_host > 0  # the second forward moved what did not fit
    model.zero_grad()
    (loss + big).backward()
    ref = deep(depth=16)
    (ref(small.cpu()).square().mean() + ref(large.cpu()).square().mean()).backward()
    assert_equal_grads(sim_grads(model), [p.grad for p in ref.parameters()])
