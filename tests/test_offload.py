"""OffloadActivations: the graph owns every payload.

On CPU, ``force_host_copy=True`` makes offloading really happen (host copies in separate
buffers, activations freed after pack), so lifetimes are proven here; stream tests run on
an accelerator, or on the test suite's simulated one (``tests/simdev``) without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import leakfree
from leakfree.offload import OffloadWarning, offload_model, remove_offload_hooks
from leakfree.offload.handles import _Offloaded
from leakfree.offload.plan import _moved_under, _small_below
from leakfree.offload.pool import HostBlockPool, _size_class
from leakfree.offload.streams import _follow, _Pass, _to_prefetch
from tests._functions import raise_in_the_body


class Block(nn.Module):
    """Linear + GELU + attention-ish views/transposes + a broadcast, saved for backward."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.norm = nn.LayerNorm(d)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.up(x))
        q = h.view(*h.shape[:-1], 4, -1).transpose(-2, -3)  # views of one storage
        att = torch.softmax(q @ q.transpose(-1, -2), dim=-1) @ q
        h = att.transpose(-2, -3).reshape(h.shape)
        y = self.down(h) * self.scale.expand_as(x)  # a broadcast (stride-0) operand
        return self.norm(x + y)


class Model(nn.Module):
    def __init__(self, d: int = 32, layers: int = 2, vocab: int = 50) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.lm_head(x)


def make(seed: int = 0) -> tuple[Model, torch.Tensor]:
    torch.manual_seed(seed)
    return Model(), torch.randn(4, 8, 32)


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def reference_grads(seed: int = 0, passes: int = 1) -> list[torch.Tensor]:
    model, x = make(seed)
    for _ in range(passes):
        model(x).square().mean().backward()
    return grads(model)


def assert_equal_grads(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def offload(**kw: Any) -> leakfree.OffloadActivations:
    kw.setdefault("force_host_copy", True)
    kw.setdefault("min_offload_size", 256)
    return leakfree.OffloadActivations(**kw)


def grouping(ctx: leakfree.OffloadActivations) -> leakfree.OffloadActivations:
    """``ctx`` as after a first forward that moved enough for groups of ``batch_bytes``
    (a first forward sends every copy alone; then a group holds at most an eighth of what
    a forward moved, which the few bytes of a unit test would make nothing)."""
    ctx._planner.capacity = ctx.batch_bytes
    return ctx


# --- offloading really happens, and gradients are bit-identical -------------------------------


def test_gradients_bit_identical() -> None:
    model, x = make()
    ctx = offload()
    with ctx:
        loss = model(x).square().mean()
    assert ctx.pool.stats.in_use_bytes > 0  # something was offloaded
    loss.backward()
    assert_equal_grads(grads(model), reference_grads())
    assert ctx.pool.stats.in_use_bytes == 0  # every host copy returned after backward


def test_activations_leave_the_device(no_gc: None) -> None:
    """After pack, the graph holds only the handle: the activation's storage is freed."""
    lin = nn.Linear(64, 64)
    x = torch.randn(16, 64)
    with offload():
        h = lin(x)
        r = weakref.ref(h.untyped_storage())
        y = nn.functional.gelu(h).sum()  # GeluBackward saves its input h
        del h
    assert r() is None  # only the host copy is left: the activation left the "device"
    with leakfree.NoOffload():
        h = lin(x)
        r = weakref.ref(h.untyped_storage())
        y2 = nn.functional.gelu(h).sum()
        del h
    assert r() is not None  # the control: saved by the graph as usual
    del y, y2


def test_views_of_one_storage_are_copied_once() -> None:
    ctx = offload(min_offload_size=1)
    base = torch.randn(64, 64, requires_grad=True)
    with ctx:
        a = base * 1.0  # a fresh activation; its views below are saved by the muls
        v1, v2, v3 = a[:32], a.t(), a.view(-1)
        out = (v1 * v1).sum() + (v2 * v2).sum() + (v3 * v3).sum()
    assert ctx.pool.stats.allocations == 1  # one host copy for the three views
    out.backward()
    expect = (2 * a.detach()).clone()
    expect[:32] += 2 * a.detach()[:32]
    expect += 2 * a.detach()
    assert torch.equal(base.grad, expect)


def test_small_views_of_big_storage_copy_only_their_span() -> None:
    ctx = offload(min_offload_size=1)
    big = torch.randn(1024, 64)
    w = torch.randn(64, requires_grad=True)
    with ctx:
        out = (big[3:5] * w).sum()  # saves a 2x64 view of a 256 KiB storage
    assert ctx.pool.stats.in_use_bytes == _size_class(2 * 64 * 4)
    out.backward()
    assert torch.equal(w.grad, big[3:5].sum(0))


def test_in_place_after_save_is_not_deduplicated() -> None:
    ctx = offload(min_offload_size=1, batch_bytes=0)  # each copy sent as it is made
    x = torch.randn(128, requires_grad=True)
    with ctx:
        a = x * 1.0
        graphs = [(a * a).sum()]  # saves a at version 0 (once, for both operands)
        with torch.no_grad():
            a.add_(1.0)
        graphs.append((a * a).sum())  # saves a again at version 1: a new copy
    assert ctx.pool.stats.allocations == 2
    first, second = (ctx._backward.copies.at(seq) for seq in (0, 1))
    assert ctx._backward.copies.next_seq() == 2
    assert torch.equal(first.group.on_host(), x.detach())  # each copy is a group here
    assert torch.equal(second.group.on_host(), x.detach() + 1.0)
    del graphs


def test_in_place_write_before_its_group_is_sent_is_reported_as_pytorch_does() -> None:
    """A copy waiting in its group still reads the device tensor: written in place before
    the group is sent, its bytes are not the saved ones, and its unpack says so, as PyTorch
    says without hooks (which it does not check); the copy saved after the write is fine."""
    x = torch.randn(128, requires_grad=True)

    def run() -> list[torch.Tensor]:
        a = x * 1.0
        graphs = [(a * a).sum()]
        with torch.no_grad():
            a.add_(1.0)
        graphs.append((a * a).sum())
        return graphs

    plain = run()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        plain[0].backward()
    plain[1].backward()
    expected, x.grad = x.grad, None
    ctx = grouping(offload(min_offload_size=1))
    with ctx:
        graphs = run()
    assert ctx.stats.to_host == 2 and ctx.pool.stats.allocations == 1  # one group, sent once
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*version 1"):
        graphs[0].backward()
    graphs[1].backward()
    assert torch.equal(x.grad, expected)


def test_small_copies_share_a_group_and_a_large_one_goes_alone() -> None:
    """Copies saved one after another share one host block, up to batch_bytes; a copy that
    large goes at once in a group of its own, and the smalls around it still share theirs
    (so small copies between large ones are not each given a block)."""
    ctx = grouping(offload(min_offload_size=1, batch_bytes=4096))
    w, wide = torch.randn(256, requires_grad=True), torch.randn(2048, requires_grad=True)
    small = [torch.randn(256) for _ in range(3)]  # 1 KiB each
    big = torch.randn(2048)  # 8 KiB: alone
    with ctx:
        losses = [(small[0] * w).sum(), (small[1] * w).sum()]  # mul saves small[i] only
        losses.append((big * wide).sum())
        assert ctx.stats.groups == 1  # the large copy went at once; the smalls wait
        losses.append((small[2] * w).sum())
    assert ctx.stats.groups == 2 and ctx.stats.to_host == 4
    copies = [r() for r in ctx._backward.copies.refs.values()]
    groups = [c.group for c in copies if c is not None]
    assert groups[0] is groups[1] is groups[3] and groups[2] is not groups[0]
    assert groups[2].used == big.nbytes and groups[0].used == 3 * 1024
    assert ctx.pool.stats.in_use_bytes == _size_class(3 * 1024) + _size_class(big.nbytes)
    del copies, groups
    sum(losses).backward()
    got = (w.grad, wide.grad)
    w.grad = wide.grad = None
    plain = [(small[0] * w).sum(), (small[1] * w).sum(), (big * wide).sum()]
    sum([*plain, (small[2] * w).sum()]).backward()
    assert torch.equal(got[0], w.grad) and torch.equal(got[1], wide.grad)
    assert ctx.pool.stats.in_use_bytes == 0


def test_copies_of_two_dtypes_saved_in_turn_fill_one_group_each() -> None:
    """A mixed-precision layer saves float32 statistics between bfloat16 activations: one
    open group per dtype, so neither closes the other's (one group would have been sent
    at every change of dtype)."""
    ctx = grouping(offload(min_offload_size=1))
    w16 = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    w32 = torch.randn(64, requires_grad=True)
    xs = [torch.randn(64, dtype=torch.bfloat16) if i % 2 else torch.randn(64) for i in range(8)]

    def forward() -> torch.Tensor:
        return sum((x * (w16 if x.dtype is torch.bfloat16 else w32)).float().sum() for x in xs)

    with ctx:
        loss = forward()
    assert ctx.stats.to_host == 8 and ctx.stats.groups == 2
    loss.backward()
    got = (w16.grad, w32.grad)
    w16.grad = w32.grad = None
    forward().backward()
    assert torch.equal(got[0], w16.grad) and torch.equal(got[1], w32.grad)


def test_groups_hold_at_most_an_eighth_of_what_a_forward_moves() -> None:
    """A first forward sends every copy alone (nothing says yet how much a forward moves);
    after it, a group holds up to batch_bytes, at most an eighth of what the last planned
    forward moved: a group is on the device twice (until sent, and in backward until its
    last use), so grouping adds at most about that much to the device peak."""
    model, x = make()  # activations of 4 KiB
    ctx = offload()
    ctx.update_model_params(model)
    for step in range(2):
        before, capacity = dataclasses.replace(ctx.stats), ctx._planner.capacity
        with ctx:
            loss = model(x).square().mean()
        copies, groups = ctx.stats.to_host - before.to_host, ctx.stats.groups - before.groups
        sizes = [
            c.group.used for c in (r() for r in ctx._backward.copies.refs.values()) if c and c.group
        ]
        if step == 0:
            assert capacity == 0 and groups == copies
        else:
            plan = ctx.plan
            assert plan is not None and 0 < capacity == plan.moved_bytes // 8
            assert capacity < ctx.batch_bytes  # the small model's eighth decides
            assert groups < copies and max(sizes) <= capacity
        loss.backward()
    assert_equal_grads(grads(model), reference_grads(passes=2))


class Normed(nn.Module):
    """Linear layers each followed by a LayerNorm, a look at the first row after the first
    layer, then an RMS scale: per layer two activations of batch x width floats and the
    norm's two per-row statistics (batch floats each: the small storages), a small view
    (the first row) of a large storage, and the scale's statistic (saved by two nodes)."""

    def __init__(self, width: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *(m for _ in range(layers) for m in (nn.Linear(width, width), nn.LayerNorm(width)))
        )
        self.gate = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers[:2](x)
        peek = (h[:1] * self.gate).sum()  # the mul saves h[:1]: 1 KiB of a 64 KiB storage
        y = self.layers[2:](h)
        r = torch.rsqrt(y.square().mean(-1, keepdim=True) + 1e-6)  # saved by rsqrt
        z = y * r  # which the mul saves again: one small storage, saved twice
        return z.square().mean() + peek


def normed_pair() -> tuple[Normed, Normed]:
    """A seeded ``Normed`` for the manager under test, and an equal one for plain PyTorch."""
    torch.manual_seed(0)
    model, plain = Normed(), Normed()
    plain.load_state_dict(model.state_dict())
    return model, plain


def _normed_steps(
    batches: tuple[int, ...], ctx: leakfree.OffloadActivations | None = None, **kw: Any
) -> tuple[leakfree.OffloadActivations, list[tuple[int, int]]]:
    """Steps of ``Normed`` under ``ctx`` (by default ``offload(min_offload_size=1, **kw)``):
    per step, the copies to the host and their bytes; gradients checked against plain
    PyTorch at every step."""
    model, plain = normed_pair()
    ctx = ctx or offload(min_offload_size=1, **kw)
    ctx.update_model_params(model)
    moved = []
    for batch in batches:
        x = torch.randn(batch, 256)
        before = dataclasses.replace(ctx.stats)
        with ctx:
            loss = model(x)
        after = ctx.stats
        moved.append((after.to_host - before.to_host, after.to_host_bytes - before.to_host_bytes))
        model.zero_grad()
        plain.zero_grad()
        loss.backward()
        plain(x).backward()
        assert_equal_grads(grads(model), grads(plain))
    return ctx, moved


def test_the_smallest_storages_stay_on_the_device_after_the_first_forward() -> None:
    """The plan keeps the smallest saved storages where they are, while together they are
    at most a 64th of what a forward saves: each would cost a handle, a host copy, its
    share of a transfer each way and a view, for bytes that save next to nothing. A small
    view of a large storage still moves (keeping it would keep the large storage)."""
    act = 64 * 256 * 4  # one activation: batch 64 x width 256 floats
    ctx, moved = _normed_steps((64, 64, 64))
    _, every = _normed_steps((64, 64, 64), keep_small=False)
    # 10 activations, 9 statistics of 256 B, the first row: 20 copies in a first forward
    assert moved[0] == every[0] == (20, 10 * act + 9 * 256 + 1024)
    # then a tail of twice the largest copy stays (the last two activations; without
    # keep_small, the last one and the scale's statistic); with keep_small the statistics
    # stay, and the first row, a small view of a large storage, still moves
    assert moved[1] == moved[2] == (9, 8 * act + 1024)
    assert every[1] == every[2] == (18, 9 * act + 1024 + 8 * 256)
    plan = ctx.plan
    assert plan is not None and plan.replans == 0  # the same choice every forward
    assert (plan.small, plan.small_bytes, plan.small_below) == (9, 9 * 256, act)
    assert "9 small ones (2.2 KiB, each under 64.0 KiB) stay as well" in str(plan)
    for kw in ({"keep_small": False}, {"device_budget": 64 * 1024}):  # the rule is off
        other = _normed_steps((64, 64), **kw)[0].plan
        assert other is not None and other.small == other.small_below == 0


def test_small_storages_follow_the_shapes_of_the_forward() -> None:
    """A forward of other lengths keeps small storages only within the bytes the plan kept
    for them: activations that shrank under the old mark still move (kept, they would make
    no copy, and every later forward would keep them all). One whose small storages
    outgrow those bytes makes more copies than the plan: a new plan weighs every storage
    it saved. One of as many copies follows the plan by place, whatever their sizes."""
    ctx, moved = _normed_steps((64, 64, 128, 128, 32, 32, 64))
    row = 256 * 4  # bytes per row of the batch
    # batch 128: the statistics (512 B each) outgrow the room the plan of batch 64 kept
    # for them (9 of 256 B): more copies, a new plan, where they stay
    assert moved[2][0] > 11 and moved[3] == (9, 8 * 128 * row + row)
    assert moved[5] == (9, 8 * 32 * row + row)  # batch 32, under the mark of batch 128
    assert moved[6] == (9, 8 * 64 * row + row)  # batch 64 again: the same plan, by place
    plan = ctx.plan
    assert plan is not None and plan.replans == 1  # the count changed once
    assert (plan.small, plan.small_bytes, plan.small_below) == (9, 9 * 512, 128 * row)


def test_keep_small_set_later_is_checked_and_plans_again() -> None:
    """Switching the rule forgets the plan made by the other one: the next forward plans
    again, as a first forward does (a plan kept as it was would never change while the
    shapes stay the same)."""
    ctx, _ = _normed_steps((64, 64))
    for bad in (1, "no"):
        with pytest.raises(ValueError, match=r"keep_small = .*: expected True or False"):
            ctx.keep_small = bad  # type: ignore[assignment]
    assert ctx.keep_small is True and ctx.plan is not None and ctx.plan.small == 9
    ctx.keep_small = False
    assert ctx.plan is None
    _, moved = _normed_steps((64, 64), ctx)
    act = 64 * 1024
    assert moved == [(20, 10 * act + 9 * 256 + 1024), (18, 9 * act + 1024 + 8 * 256)]
    ctx.keep_small = True
    _, moved = _normed_steps((64, 64), ctx)
    assert moved[1] == (9, 8 * act + 1024) and ctx.plan is not None and ctx.plan.small == 9


def test_a_small_model_whose_plan_moves_nothing_keeps_its_choice() -> None:
    """A plan that moves nothing keeps its saved tensors as they are, counted by storage
    as the plan counts its copies: counted per saved tensor, the sigmoid's output (saved
    by the sigmoid and by the square) counted twice, the forward outgrew the plan, made
    copies of part of what it saved, and planned again from that part, without the
    norm's statistics (the review's model)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(64), nn.Sigmoid())
    ctx = offload(min_offload_size=1)
    ctx.update_model_params(model)
    x = torch.randn(4, 64, requires_grad=True)
    moved = []
    for _ in range(4):
        before = ctx.stats.to_host
        with ctx:
            loss = model(x).square().mean()
        moved.append(ctx.stats.to_host - before)
        loss.backward()
    plan = ctx.plan
    assert plan is not None and plan.moved == plan.replans == 0 and plan.small == 2
    assert moved == [4, 0, 0, 0]  # x, mean, rstd, the output; then nothing moves


@pytest.mark.parametrize("whole", [False, True], ids=["views only", "and the storage whole"])
def test_a_storage_saved_as_several_views_is_weighed_once(whole: bool) -> None:
    """The small-storage rule weighs what a forward saves by storage: q, k and v, three
    views of one 192 KiB storage, saved as three copies of their spans (and the storage
    itself, copied whole), weigh 192 KiB, once. Weighed per copy, 1/64 of it would have
    made room for the four 1 KiB storages beside them."""
    qkv = torch.randn(3, 64, 256)
    weights = [torch.randn(256, requires_grad=True) for _ in range(5)]
    smalls = [torch.randn(256) for _ in range(4)]

    def forward() -> torch.Tensor:
        q, k, v = qkv.unbind(0)
        loss = sum((t * w).sum() for t, w in zip((q, k, v), weights))
        if whole:
            loss = loss + (qkv * weights[3]).sum()
        return loss + sum((s * weights[4]).sum() for s in smalls)

    ctx = offload(min_offload_size=1)
    for _ in range(2):
        with ctx:
            loss = forward()
        loss.backward()
    plan = ctx.plan
    assert plan is not None and plan.small == plan.small_below == 0


def test_device_budget_set_later_is_checked_and_plans_again() -> None:
    """A plan made without a budget (its tail, its small storages) is forgotten when a
    budget is set: device_budget=0 moves everything from the next forward on."""
    ctx, _ = _normed_steps((64, 64))
    for bad in (-1, 1.5, "1 GB"):
        with pytest.raises(ValueError, match=r"device_budget = .*: expected None or an int"):
            ctx.device_budget = bad  # type: ignore[assignment]
    assert ctx.device_budget == "auto" and ctx.plan is not None and ctx.plan.small == 9
    ctx.device_budget = 0
    assert ctx.plan is None
    _, moved = _normed_steps((64, 64), ctx)
    assert moved[0] == moved[1] == (20, 10 * 64 * 1024 + 9 * 256 + 1024)
    assert ctx.plan is not None and ctx.plan.small == ctx.plan.kept == 0


def test_small_storages_stay_across_gradient_accumulation() -> None:
    """Two forwards under their own blocks, then one backward: each forward keeps its own
    small storages within the plan's bytes (the room is per forward), the plan stays as it
    is, and gradients match plain PyTorch."""
    model, plain = normed_pair()
    ctx = offload(min_offload_size=1)
    ctx.update_model_params(model)
    xs = [torch.randn(64, 256) for _ in range(2)]
    for _ in range(3):
        before = ctx.stats.to_host
        losses = []
        for x in xs:
            with ctx:
                losses.append(model(x))
        model.zero_grad()
        sum(losses).backward()
    # per forward 8 activations and the row; and the first forward's tail of two, which
    # the second's moves (one budget of twice the largest copy for the graphs alive)
    assert ctx.stats.to_host - before == 2 * 9 + 2
    plan = ctx.plan
    assert plan is not None and plan.replans == 0 and plan.small == 9
    plain.zero_grad()
    sum(plain(x) for x in xs).backward()
    assert_equal_grads(grads(model), grads(plain))


@pytest.mark.parametrize(
    ("sizes", "below"),
    [
        ([1000] * 10 + [10] * 5, 1000),  # the five smalls fit in 1/64 of 10050 bytes
        ([100] * 63 + [60, 60], 0),  # two of 60 would pass 100: all of one size or none
        ([1] * 10 + [64] * 100, 64),
        ([640], 0),
        ([], 0),
    ],
)
def test_small_storages_are_the_smallest_within_a_64th(sizes: list[int], below: int) -> None:
    assert _small_below(sizes) == below


def test_a_group_dropped_before_it_is_sent_copies_nothing(no_gc: None) -> None:
    """A graph dropped inside the block takes its open group with it: nothing is sent and
    no host block is taken. A saved output (sigmoid's) holds its group through its
    grad_fn until the group is sent: __exit__ sends it, and everything is freed then."""
    ctx = grouping(offload(min_offload_size=1))
    x = torch.randn(256, requires_grad=True)
    with ctx:
        e = (x * 2.0).exp()  # exp saves its output: a cycle through its grad_fn
        out_storage = StorageWeakRef(e.untyped_storage())
        loss = e.sum()
        del e, loss
        assert ctx.stats.groups == 0 and not out_storage.expired()  # held by the cycle
    assert ctx.stats.groups == 1 and out_storage.expired()  # sent, and the cycle broken
    assert ctx.pool.stats.in_use_bytes == 0
    with ctx:
        loss = (x * 2.0).sum() * x.sum()  # mul saves inputs only: no cycle
        del loss
    assert ctx.stats.groups == 1 and ctx.pool.stats.allocations == 1  # nothing new


def test_backward_inside_the_block_sends_the_open_group_first() -> None:
    """A backward before the forward's with-block ends (the open group not sent yet):
    the group is sent, then brought back; the forward then goes on in a new group."""
    model, x = make()
    ctx = offload()
    with ctx:
        model(x).square().mean().backward()
        assert ctx.stats.groups >= 1
        sent = ctx.stats.groups
        loss = model(x).square().mean()
    loss.backward()
    assert ctx.stats.groups > sent
    assert_equal_grads(grads(model), reference_grads(passes=2))


def test_a_tensor_saved_by_several_nodes_gets_one_view_per_pass() -> None:
    """While a pass keeps a group, a geometry asked for again (one tensor saved by two
    nodes) gets the view made the first time: one view op, not one per node."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Views(TorchDispatchMode):
        made = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):  # type: ignore[no-untyped-def]
            Views.made += func is torch.ops.aten.as_strided.default
            return func(*args, **(kwargs or {}))

    ctx = grouping(offload(min_offload_size=1))
    w = torch.randn(64, requires_grad=True)
    a, b = torch.randn(64), torch.randn(64)
    with ctx:  # a and b in one group: each comes back as a view of it
        loss = (a * w).sum() + (a * w * 2.0).sum() + (b * w).sum()  # a saved twice
    assert ctx.stats.to_host == 2 and ctx.stats.groups == 1
    with Views():
        loss.backward()
    assert Views.made == 2  # a's view, once; b's
    got, w.grad = w.grad, None
    ((a * w).sum() + (a * w * 2.0).sum() + (b * w).sum()).backward()
    assert torch.equal(got, w.grad)


# --- lifetimes: the graph owns everything -----------------------------------------------------


def test_forward_without_backward_frees_everything_with_the_graph(no_gc: None) -> None:
    model, x = make()
    ctx = offload()
    with ctx:
        loss = model(x).square().mean()
    handles = list(ctx._backward.copies.refs.values())  # the host copies, weakly, in creation order
    assert handles and all(h() is not None for h in handles)
    in_use = ctx.pool.stats.in_use_bytes
    assert in_use > 0
    del loss  # the graph dies without backward: TRL kept these until the next __enter__
    assert all(h() is None for h in handles)
    assert ctx.pool.stats.in_use_bytes == 0
    assert ctx.pool.stats.cached_bytes == in_use  # blocks back in the pool, reusable


def test_two_forwards_in_separate_blocks_then_one_backward() -> None:
    model, x = make()
    ctx = offload()
    with ctx:
        loss1 = model(x).square().mean()
    with ctx:  # TRL's __enter__ wiped the first graph's entries here: "Untracked tensor"
        loss2 = model(x * 2).square().mean()
    (loss1 + loss2).backward()
    ref, xr = make()
    (ref(xr).square().mean() + ref(xr * 2).square().mean()).backward()
    assert_equal_grads(grads(model), grads(ref))
    assert ctx.pool.stats.in_use_bytes == 0


def test_backward_retain_graph_twice_same_gradients() -> None:
    model, x = make()
    ctx = offload()
    with ctx:
        loss = model(x).square().mean()
    loss.backward(retain_graph=True)
    first = grads(model)
    assert ctx.pool.stats.in_use_bytes > 0  # retained graph: payloads stay
    model.zero_grad()
    loss.backward()  # TRL: "Untracked tensor" (unpack deleted the entry)
    assert_equal_grads(first, grads(model))
    assert_equal_grads(first, reference_grads())
    assert ctx.pool.stats.in_use_bytes == 0


def test_exception_in_body_pops_hooks_and_retains_nothing(no_gc: None) -> None:
    model, x = make()
    ctx = offload()
    raise_in_the_body(ctx, model, x)
    assert ctx.pool.stats.in_use_bytes == 0
    allocations = ctx.pool.stats.allocations
    model(x).square().mean().backward()  # outside: hooks must be gone
    assert ctx.pool.stats.allocations == allocations
    assert ctx.pool.stats.reuses == 0


def test_nested_no_offload() -> None:
    model, x = make()
    one = offload()
    one.update_model_params(model)  # the buffer's expand_as view: never offloaded
    with one:
        kept = model(x.clone()).square().mean()
    per_forward = one.stats.to_host_bytes  # bytes one forward offloads
    assert per_forward > 0
    del kept
    xa, xb, xc, xd = (x.clone() for _ in range(4))  # distinct storages: no dedup across
    ctx = offload()
    ctx.update_model_params(model)
    with ctx:
        with leakfree.NoOffload():
            loss_a = model(xa).square().mean()
            with ctx:  # offloading again, inside NoOffload
                loss_b = model(xb).square().mean()
            with leakfree.NoOffload():
                loss_c = model(xc).square().mean()
        assert ctx.stats.to_host_bytes == per_forward  # only loss_b so far
        loss_d = model(xd).square().mean()
    assert ctx.stats.to_host_bytes == 2 * per_forward  # loss_b and loss_d
    (loss_a + loss_b + loss_c + loss_d).backward()
    assert_equal_grads(grads(model), reference_grads(passes=4))


def test_steps_flat_live_bytes() -> None:
    # Flat from step 1 on: a few steps prove it (the long runs live in benchmarks/offload.py).
    model, x = make()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ctx = offload()
    series = []
    for _ in range(8):
        with ctx:
            loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        series.append((ctx.pool.stats.in_use_bytes, ctx.pool.stats.pooled_bytes))
    assert all(s[0] == 0 for s in series)  # nothing held between steps
    # the pool stopped growing after step 2 (the first one grouped as planned)
    assert len({s[1] for s in series[2:]}) == 1
    # On CPU restored tensors view their host blocks (no copy back), so a block leaves
    # the pool with its graph instead of being reused: the pool makes the next step's as
    # a backward pass ends (test_pool), and test_streams covers reuse.
    assert ctx.pool.stats.misses == ctx.pool.stats.allocations - ctx.pool.stats.ahead


def test_parameters_buffers_and_small_tensors_stay() -> None:
    lin = nn.Linear(64, 64)
    ctx = offload(min_offload_size=10**9)
    x = torch.randn(8, 64, requires_grad=True)
    with ctx:
        lin(x).sum()
    assert ctx.pool.stats.allocations == 0  # everything below min_offload_size
    ctx = offload(min_offload_size=1)
    ctx.update_model_params(lin)
    w_view = lin.weight.detach()  # a plain tensor sharing the parameter's storage
    with ctx:
        out = (x * x).sum() + (x.detach() @ w_view).sum() + lin(x).sum()
    # x is saved (by x * x) and offloaded; the weight's storage, saved as w_view and as
    # weight.t() by linear, is skipped (matched by storage, not by type)
    assert ctx.pool.stats.allocations == 1
    out.backward()
    bare = offload(min_offload_size=1)  # no update_model_params: parameter views still stay
    with bare:
        out = lin(x).sum()  # saves x (offloaded) and weight.t() (a view of a Parameter: kept)
    assert bare.pool.stats.allocations == 1
    del out


def test_no_accelerator_no_option_is_a_noop() -> None:
    if torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator")
    ctx = leakfree.OffloadActivations()  # TRL raises AttributeError here
    assert ctx.enabled is False and ctx.device is None
    model, x = make()
    with ctx:
        loss = model(x).square().mean()
    loss.backward()
    assert ctx.pool.stats.allocations == 0
    assert_equal_grads(grads(model), reference_grads())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_fwd_stash_size": 0}, "max_fwd_stash_size=0"),
        ({"max_fwd_stash_size": 1.5}, "max_fwd_stash_size=1.5"),
        ({"max_fwd_stash_size": True}, "max_fwd_stash_size=True"),
        ({"prefetch_bytes": -1}, "prefetch_bytes=-1"),
        ({"prefetch_bytes": 2.0}, "prefetch_bytes=2.0"),
        ({"device_budget": -1}, "device_budget=-1"),
        ({"device_budget": "1GB"}, "device_budget='1GB'"),
        ({"device_budget": True}, "device_budget=True"),
        ({"batch_bytes": -1}, "batch_bytes=-1"),
        ({"batch_bytes": None}, "batch_bytes=None"),
        ({"keep_small": 1}, "keep_small=1"),
        ({"min_offload_size": -1}, "min_offload_size=-1"),
        ({"device": "cpu"}, "force_host_copy=True"),
        ({"pin_memory_budget": -5, "force_host_copy": True}, "budget=-5"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        leakfree.OffloadActivations(**kwargs)


# --- the decisions behind the streams, checked without a GPU ----------------------------------


def _handles(n: int) -> tuple[leakfree.OffloadActivations, list[_Offloaded]]:
    """n real handles from a CPU forward (one per saved activation), each copy in a group
    of its own (``h.copy.group``)."""
    ctx = offload(min_offload_size=1, batch_bytes=0)
    xs = [torch.randn(16, requires_grad=True) for _ in range(n)]
    out: list[_Offloaded] = []
    for x in xs:
        out.append(ctx._pack(x * 1.0))
    return ctx, out


def _pass_over(copies: list[Any], ctx: Any) -> _Pass:
    """A pass state following the order groups ``copies`` were unpacked in (as a pass
    records)."""
    state = _Pass()
    state.order = [c.seq for c in copies]
    follow = _Pass()
    _follow(state.learned(), copies[0], ctx._backward.copies, follow)
    return follow


def test_prefetch_follows_the_learned_order_within_the_byte_window() -> None:
    ctx, hs = _handles(6)
    copies = [h.copy.group for h in hs]  # 64 bytes each
    order = [copies[i] for i in (5, 3, 4, 1, 2, 0)]  # not pack order: what backward did
    state = _pass_over(order, ctx)
    assert [r() for r in state.following] == order
    assert _to_prefetch(state, copies[5], window=128) == [copies[3], copies[4]]
    assert state.outstanding == 128
    assert _to_prefetch(state, copies[3], window=128) == []  # the window is full
    state.outstanding = 0  # both were used
    keep = torch.empty(1)
    copies[1].restored = (weakref.ref(keep.untyped_storage()), None)  # alive: skipped
    assert _to_prefetch(state, copies[4], window=64) == [copies[2]]
    assert _to_prefetch(state, copies[0], window=64) == []  # the end of the order
    assert _to_prefetch(_Pass(), copies[5], window=10**9) == []  # nothing learned: none


def test_prefetch_takes_one_copy_larger_than_the_window() -> None:
    ctx, hs = _handles(3)
    state = _pass_over([h.copy.group for h in reversed(hs)], ctx)
    assert _to_prefetch(state, hs[2].copy.group, window=1) == [hs[1].copy.group]


def test_a_learned_order_is_followed_only_where_the_copies_match_it() -> None:
    ctx, hs = _handles(4)
    copies = [h.copy.group for h in hs]
    state = _Pass()
    state.order = [c.seq for c in reversed(copies)]
    order = state.learned()
    assert order == (0, -1, -2, -3)
    _, more = _handles(1)  # another manager's copy: not in ctx's registry
    shifted = _Pass()
    _follow(order, copies[2], ctx._backward.copies, shifted)  # would start before the first copy
    assert shifted.following == []
    again = _Pass()
    _follow(order, copies[3], ctx._backward.copies, again)
    assert [r() for r in again.following] == list(reversed(copies))
    del hs[1], copies[1]  # a recorded copy died: the shape no longer matches
    gone = _Pass()
    _follow(order, again.following[0](), ctx._backward.copies, gone)
    assert gone.following == []
    _follow((0, 1), more[0].copy.group, ctx._backward.copies, gone)  # not this one's copies
    assert gone.following == []


def test_copies_registry_keeps_about_twice_the_live_copies() -> None:
    ctx = offload(min_offload_size=1)
    w = torch.randn(16, requires_grad=True)
    with ctx:  # one with-block around a whole loop
        kept = (torch.randn(16) * w).sum()  # one graph alive throughout: the oldest copy
        for _ in range(5000):
            (torch.randn(16) * w).sum().backward()
    copies = ctx._backward.copies
    assert copies.next_seq() > 1000  # (the plan keeps the smallest storages on the device)
    assert len(copies.refs) <= 2 * 1 + 64 + 1 and copies.at(0) is not None
    del kept


@pytest.mark.parametrize(
    ("sizes", "budget", "moved"),
    [
        ([10, 10, 10, 10], 25, 2),  # the last two fit; the first two move
        ([10, 10, 10, 10], 40, 0),  # all fit
        ([10, 10, 10, 10], 0, 4),
        ([10, 30, 10], 25, 2),  # the 30 does not fit: it and all before it move
        ([], 10, 0),
    ],
)
def test_plan_keeps_the_latest_copies_that_fit(sizes: list[int], budget: int, moved: int) -> None:
    assert _moved_under(sizes, budget) == moved


def test_pool_budget_accounting_and_reuse() -> None:
    pool = HostBlockPool(budget=3 * 4096, pin=False)
    a, b, c = pool.acquire(100), pool.acquire(4096), pool.acquire(10)
    assert pool.stats.pooled_bytes == 3 * 4096 and pool.stats.allocations == 3
    d = pool.acquire(1)  # beyond the budget: an overflow block
    assert pool.stats.overflows == 1 and not d.pooled
    pool.release(d)
    assert pool.stats.cached_bytes == 0  # overflow blocks are freed, not cached
    pool.release(a)
    pool.release(b)
    e = pool.acquire(4000)
    assert e is a or e is b
    assert pool.stats.reuses == 1 and pool.stats.in_use_bytes == 2 * 4096
    assert pool.trim() == 4096 and pool.stats.pooled_bytes == 2 * 4096
    pool.release(c)
    pool.release(e)
    assert pool.stats.in_use_bytes == 0


def test_pool_prefers_a_block_whose_copies_completed() -> None:
    class Pending:
        """A device event stand-in: this test is about the pool's decision, not torch."""

        def __init__(self) -> None:
            self.done = False
            self.waited = False

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.waited = True
            self.done = True

    pool = HostBlockPool(budget=2 * 4096, pin=False)  # no room for a third block
    busy, idle = pool.acquire(10), pool.acquire(10)
    busy.event = pending = Pending()
    pool.release(busy)
    pool.release(idle)
    assert pool.acquire(10) is idle and idle.event is None  # the busy one is skipped
    # only the busy one left: handed out with its event, for the copy out to wait for on
    # the device (Transfers.send); the host does not wait
    assert pool.acquire(10) is busy and busy.event is pending and not pending.waited
    pool.release(busy)
    pending.done = True
    assert pool.acquire(10) is busy and busy.event is None  # seen complete: forgotten


def test_size_classes() -> None:
    # Powers of two, as PyTorch's pinned allocator rounds: a class is what really gets pinned.
    sizes = (1, 4096, 4097, 1 << 20, (1 << 20) + 1, 5 << 19)
    assert [_size_class(n) for n in sizes] == [4096, 4096, 8192, 1 << 20, 2 << 20, 4 << 20]


# --- model helpers ----------------------------------------------------------------------------


def _head_hooks(model: Model) -> int:
    head = model.lm_head
    return len(head._forward_pre_hooks) + len(head._forward_hooks)


def test_offload_model_keeps_head_on_device_and_never_stacks_hooks() -> None:
    model, x = make()
    ctx = offload_model(model, force_host_copy=True, min_offload_size=256)
    assert _head_hooks(model) == 2
    offload_model(model, force_host_copy=True, min_offload_size=256)
    ctx = offload_model(model, force_host_copy=True, min_offload_size=256)
    assert _head_hooks(model) == 2  # TRL's helper: 6 here, and no way to remove them
    with ctx:
        loss = model(x).square().mean()
    with_head_guard = ctx.stats.to_host_bytes
    loss.backward()
    assert_equal_grads(grads(model), reference_grads())
    assert remove_offload_hooks(model) == 2
    assert _head_hooks(model) == 0
    plain = offload()  # the same configuration, without the head guard
    plain.update_model_params(model)
    model.zero_grad()
    with plain:
        loss = model(x).square().mean()
    without_head_guard = plain.stats.to_host_bytes
    loss.backward()
    # exactly the head's input (4x8x32 floats) is offloaded without the guard
    assert without_head_guard - with_head_guard == 4 * 8 * 32 * 4


def test_offload_model_explicit_head_and_errors() -> None:
    model, _ = make()
    offload_model(model, head="blocks.1.norm", force_host_copy=True)
    norm = model.blocks[1].norm
    assert len(norm._forward_pre_hooks) == 1
    with pytest.raises(ValueError, match=r"head='nope'"):
        offload_model(model, head="nope", force_host_copy=True)
    remove_offload_hooks(model)
    with pytest.warns(OffloadWarning, match="no output head"):
        offload_model(nn.Sequential(nn.Linear(2, 2)), force_host_copy=True)


def test_head_exception_still_exits_no_offload() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("head failed")

    model, x = make()
    model.lm_head = Boom()  # type: ignore[assignment]
    ctx = offload_model(model, force_host_copy=True, min_offload_size=256)
    with pytest.raises(RuntimeError, match="head failed"), ctx:
        model(x)
    # had the NoOffload guard stayed pushed, this would not offload:
    with ctx:
        model.blocks[0](x).sum()
    assert ctx.pool.stats.allocations > 0


# --- on an accelerator: streams ---------------------------------------------------------------


@pytest.mark.parametrize("use_streams", [True, False])
def test_accelerator_gradients_and_lifetimes(use_streams: bool, accelerator: torch.device) -> None:
    device = accelerator
    model, x = make()
    model, x = model.to(device), x.to(device)
    ctx = leakfree.OffloadActivations(use_streams=use_streams, min_offload_size=256)
    with ctx:
        loss = model(x).square().mean()
    assert len(ctx._transfers.in_flight) == 0  # __exit__ retired every in-flight copy
    loss.backward()
    got = grads(model)
    ref_model, xr = make()
    ref_model, xr = ref_model.to(device), xr.to(device)
    ref_model(xr).square().mean().backward()
    assert_equal_grads(got, grads(ref_model))
    assert ctx.pool.stats.in_use_bytes == 0
    if use_streams:
        assert ctx._transfers.side_streams  # a side stream was made and used


def test_accelerator_in_flight_bounded_and_memory_drops(accelerator: torch.device) -> None:
    device = accelerator
    mod = torch.get_device_module(device)
    layers = nn.Sequential(*[nn.Linear(256, 256) for _ in range(16)]).to(device)
    x = torch.randn(256, 256, device=device)
    mod.synchronize()
    mod.reset_peak_memory_stats()
    base = mod.memory_allocated()
    with leakfree.NoOffload():
        y = layers(x).sum()
    plain = mod.memory_allocated() - base
    del y
    ctx = leakfree.OffloadActivations(max_fwd_stash_size=2, min_offload_size=1024)
    activation = 256 * 256 * 4
    with ctx:
        y = layers(x).sum()
        held = mod.memory_allocated() - base
    offloaded = mod.memory_allocated() - base
    assert held < (2 + 2) * activation  # at most the in-flight window, plus the last output
    assert offloaded < plain / 4
    y.backward()
    got = [p.grad.clone() for p in layers.parameters()]
    layers.zero_grad()
    layers(x).sum().backward()
    for a, p in zip(got, layers.parameters()):
        assert torch.equal(a, p.grad)


# --- regressions from review ----------------------------------------------------------------


@pytest.mark.parametrize("which", ["offload", "no_offload"])
def test_saved_outputs_dropped_without_backward_are_freed(which: str, no_gc: None) -> None:
    """A saved *output* arrives at the pack hook with its grad_fn: kept as is, it is a cycle
    through C++ that no collector frees (identity hooks, e.g. TRL's NoOpManager, leak)."""
    ctx = offload() if which == "offload" else leakfree.NoOffload()
    x = torch.randn(8, 16, requires_grad=True)
    for f in (torch.sigmoid, lambda t: t.softmax(-1), torch.relu, torch.exp):
        with ctx:
            out = f(x * 1.0)  # small: below min_offload_size, kept on the device
        r = weakref.ref(out.untyped_storage())
        del out
        assert r() is None
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        out = torch.sigmoid(x * 1.0)
    r = weakref.ref(out.untyped_storage())
    del out
    assert r() is not None  # the control: identity hooks leak it
    r().resize_(0)  # (free the bytes; the cycle itself stays until the process ends)


def test_double_backward_matches_plain() -> None:
    results = []
    for ctx in (leakfree.NoOffload(), offload(min_offload_size=1)):
        x = torch.linspace(-1, 1, 64, requires_grad=True)
        with ctx:
            y = (torch.tanh(x) * torch.sigmoid(x) * x.exp()).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
        results.append((g.detach(), gg))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("which", ["offload_kept", "no_offload"])
def test_in_place_after_save_is_reported_like_pytorch(which: str) -> None:
    ctx = offload(min_offload_size=10**9) if which == "offload_kept" else leakfree.NoOffload()
    x = torch.randn(8, requires_grad=True)
    with ctx:
        a = x * 1.0
        y = (a * a).sum()
    with torch.no_grad():
        a.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*version 1"):
        y.backward()


def test_ctx_is_freed_by_refcounting(no_gc: None) -> None:
    ctx = offload()
    model, x = make()
    with ctx:
        model(x).sum().backward()
    r = weakref.ref(ctx)
    del ctx
    assert r() is None  # the hooks hold it weakly: no cycle, its pool goes at once


# --- one `with` around a whole loop: each forward recorded, planned and let go -----------


def _steps(ctx: Any, n: int, *, around: bool = True, budget_check: Any = None) -> list[Any]:
    """``n`` training steps of ``make()``'s model (constant shapes), in one ``with``
    (``around``) or one per forward; returns each step's gradients."""
    model, x = make()
    out = []
    with ctx if around else contextlib.nullcontext():
        for _ in range(n):
            with contextlib.nullcontext() if around else ctx:
                loss = model(x).square().mean()
            loss.backward()
            out.append(grads(model))
            for p in model.parameters():
                p.grad = None
    return out


def test_one_with_around_a_loop_records_one_forward_at_a_time_and_follows_its_plan() -> None:
    """A forward ends where its step's backward began: the record then holds one forward's
    copies however long the block stays open, the plan is made from it (and followed by
    the next forward of the same shapes), and gradients are plain PyTorch's."""
    one = offload(device_budget=4 << 10)
    per_step = offload(device_budget=4 << 10)
    long_run = _steps(one, 40)
    reference = _steps(per_step, 40, around=False)
    model, x = make()
    for got, want in zip(long_run, reference):
        assert_equal_grads(got, want)
    model(x).square().mean().backward()
    assert_equal_grads(long_run[-1], grads(model))
    assert one.plan == per_step.plan and one.plan is not None and one.plan.replans == 0
    assert one.stats == per_step.stats  # the same copies, both ways, as with one block each
    assert len(one._forward.sizes) == 0
    assert len(one._keeper._held) <= len(per_step._keeper._held) + 1


@pytest.mark.parametrize("drop", ["at-once", "next-step"])
def test_forwards_without_backward_in_one_with_leave_a_bounded_record(drop: str) -> None:
    """An evaluation loop with grad on, inside the training loop's ``with``: graphs dropped
    without backward (at once, or when the next forward's output replaces them). The
    record holds at most twice what is alive of it, plus 64 entries."""
    model, x = make()
    ctx = offload(device_budget=0)  # every copy moves: as many per forward
    out = None
    per_forward = 0
    with ctx:
        for i in range(200):
            out = model(x) if drop == "next-step" else model(x).sum().detach()
            if i == 0:
                per_forward = ctx._backward.copies.next_seq()
            assert len(ctx._forward.sizes) <= 2 * 2 * per_forward + 64
            assert len(ctx._backward.copies.refs) <= 2 * 2 * per_forward + 64
    assert ctx._backward.copies.next_seq() > 150 * per_forward  # it kept offloading
    del out


def test_double_backward_in_one_with_matches_plain_and_saves_into_its_forward() -> None:
    """A save made by backward itself (create_graph) belongs to the graph it extends:
    it does not begin a new forward."""
    results = []
    for ctx in (leakfree.NoOffload(), offload(min_offload_size=1)):
        x = torch.linspace(-1, 1, 64, requires_grad=True)
        with ctx:
            for _ in range(3):
                y = (torch.tanh(x) * torch.sigmoid(x) * x.exp()).sum()
                (g,) = torch.autograd.grad(y, x, create_graph=True)
                (gg,) = torch.autograd.grad(g.sum(), x)
                results.append((g.detach(), gg))
    for (g0, gg0), (g1, gg1) in zip(results[:3], results[3:]):
        assert torch.equal(g0, g1) and torch.equal(gg0, gg1)


def test_nested_same_instance_shares_the_session() -> None:
    ctx = offload(min_offload_size=1)
    x = torch.randn(64, requires_grad=True)
    with ctx:
        a = x * 1.0
        y1 = (a * a).sum()
        with ctx:
            y2 = (a * 3.0 * 1.0).sum() + (a * a).sum()  # a again: deduplicated
        y3 = (a * a).sum()  # still deduplicated after the inner exit
    assert ctx.pool.stats.allocations == 1
    (y1 + y2 + y3).backward()


def test_pool_evicts_other_size_classes_before_overflowing() -> None:
    pool = HostBlockPool(budget=4 * 4096, pin=False)
    small = [pool.acquire(4096) for _ in range(4)]
    for b in small:
        pool.release(b)
    del small, b  # only the pool holds them now: evicting frees their bytes
    big = pool.acquire(3 * 4096)  # size class 16384: evict cached 4 KiB blocks, no overflow
    stats = pool.stats
    assert stats.overflows == 0 and big.pooled
    assert stats.pooled_bytes == 16384 and stats.cached_bytes == 0


# --- every tensor kind save_on_cpu takes ------------------------------------------------------


def _kind(name: str) -> tuple[tuple[torch.Tensor, ...], Any]:
    torch.manual_seed(0)
    if name == "nested (strided layout)":
        a = torch.nested.nested_tensor([torch.randn(300, 4), torch.randn(500, 4)])
        return (a.requires_grad_(),), lambda a: (a * a).to_padded_tensor(0.0).sum()
    if name == "nested (jagged layout)":
        parts = [torch.randn(300, 4), torch.randn(500, 4)]
        a = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=True)
        return (a,), lambda a: (a * a).sin().values().sum()
    if name == "sparse COO":
        s = torch.randn(50, 50).relu().to_sparse().requires_grad_()
        d = torch.randn(50, 50, requires_grad=True)
        return (s, d), lambda s, d: torch.sparse.mm(s, d).sum()
    if name == "complex, conjugate view":
        z = torch.randn(300, dtype=torch.complex64, requires_grad=True)
        return (z,), lambda z: (z * z.conj()).real.sum()
    if name == "negative view":
        x = torch.randn(300, requires_grad=True)
        return (x,), lambda x: (x * torch._neg_view(x)).sum()
    x = torch.randn(300, 300, requires_grad=True)  # plain strided, for reference
    return (x,), lambda x: (x @ x).tanh().sum()


def _dense(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    if t.is_nested:
        return t.to_padded_tensor(0.0)
    return t.to_dense() if t.layout != torch.strided else t


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize(
    "kind",
    [
        "nested (strided layout)",
        "nested (jagged layout)",
        "sparse COO",
        "complex, conjugate view",
        "negative view",
        "strided",
    ],
)
def test_every_tensor_kind_save_on_cpu_takes_is_offloaded_or_kept(kind: str) -> None:
    """Offloaded where it can be, kept where it cannot: never a crash, same gradients."""
    results = []
    for ctx in (
        None,
        torch.autograd.graph.save_on_cpu(pin_memory=False),
        offload(min_offload_size=1),
    ):
        inputs, fn = _kind(kind)
        if ctx is None:
            out = fn(*inputs)
        else:
            with ctx:
                out = fn(*inputs)
        out.backward()
        results.append([_dense(i.grad) for i in inputs])
    plain, on_cpu, ours = results
    for a, b, c in zip(plain, on_cpu, ours):
        assert torch.equal(a, b) and torch.equal(a, c), kind


def test_a_graph_keeps_its_payloads_not_the_manager_or_its_pool() -> None:
    """The lifetime contract: the graph owns its handles and host bytes, nothing more."""
    import gc

    expected = reference_grads()
    model, x = make()
    manager = offload(min_offload_size=1)
    manager_ref, pool_ref = weakref.ref(manager), weakref.ref(manager.pool)
    with manager:
        loss = model(x).square().mean()
    del manager
    gc.collect()
    assert manager_ref() is None and pool_ref() is None  # the graph did not keep them
    loss.backward()  # and it still restores its own bytes
    assert_equal_grads(grads(model), expected)


def test_default_budget_is_one_per_process_shared_by_every_manager() -> None:
    """Several managers (one per model, one per data loader) used to get a quarter of RAM
    each. Now they draw from one process budget, counted in bytes really held."""
    from leakfree.offload.pool import PROCESS_BUDGET, HostBudget

    a, b = offload(), offload()
    assert a.pool.host_budget is b.pool.host_budget is PROCESS_BUDGET
    before = PROCESS_BUDGET.used
    block = a.pool.acquire(5000)
    assert PROCESS_BUDGET.used == before + 8192  # the size class, as the allocator pins
    a.pool.release(block)
    del block
    assert a.pool.trim() == 8192 and PROCESS_BUDGET.used == before  # freed, given back
    own = offload(pin_memory_budget=8192)
    assert own.pool.host_budget is not PROCESS_BUDGET and own.pool.budget == 8192
    shared = HostBudget(3 * 4096)
    p, q = HostBlockPool(shared, pin=False), HostBlockPool(shared, pin=False)
    held = [p.acquire(4096), q.acquire(4096), p.acquire(4096)]
    assert not q.acquire(4096).pooled  # the fourth block overflows: the budget is shared
    assert shared.used == 3 * 4096 and len(held) == 3


def test_min_offload_size_is_checked_when_set_later_too() -> None:
    """Review: the setter skipped the check __init__ does."""
    ctx = leakfree.OffloadActivations(force_host_copy=True)
    for bad in (-1, 1.5, "1k", True):
        with pytest.raises(ValueError, match=r"min_offload_size = .*: expected an int >= 0"):
            ctx.min_offload_size = bad  # type: ignore[assignment]
    assert ctx.min_offload_size == 1024
    ctx.min_offload_size = 0
    assert ctx.min_offload_size == 0


def test_trl_s_no_op_manager_name_is_an_alias() -> None:
    """Review: TRL's ``NoOpManager`` had no alias, so swapping the import broke there."""
    from leakfree.offload import NoOffload, NoOpManager

    assert NoOpManager is NoOffload
    x = torch.randn(4, requires_grad=True)
    with NoOpManager():
        y = x.sigmoid()  # saves its output: kept detached, no cycle through the node
    y.sum().backward()
    assert torch.equal(x.grad, (x.sigmoid() * (1 - x.sigmoid())).detach())


# --- one meaning per parameter ----------------------------------------------------------------


def test_the_automatic_budget_has_a_name_and_none_means_it_too() -> None:
    for value in ("auto", None):
        ctx = leakfree.OffloadActivations(force_host_copy=True, device_budget=value)
        assert ctx.device_budget == "auto" and ctx.mode.value == "auto"
    assert leakfree.OffloadActivations(force_host_copy=True).device_budget == "auto"
    with pytest.raises(ValueError, match=r'device_budget=.Auto.*or "auto"'):
        leakfree.OffloadActivations(force_host_copy=True, device_budget="Auto")


@pytest.mark.parametrize(
    ("decider", "option"),
    [
        ({"device_budget": 0}, {"keep_small": False}),
        ({"max_overhead": 0.1}, {"max_fwd_stash_size": 2}),
        ({"max_overhead": 0.05}, {"keep_small": True}),
        ({"device_limit": 1 << 30}, {"max_fwd_stash_size": 1}),
    ],
)
def test_an_option_a_budget_or_a_goal_decides_for_itself_is_refused_with_it(
    decider: dict[str, Any], option: dict[str, Any]
) -> None:
    """They were ignored without a word: a budget lets moved tensors go at once (no
    window to bound) and keeps what it keeps (no small storages besides)."""
    (name,) = option
    (other,) = decider
    with pytest.raises(ValueError, match=rf"\({other}=\d+\S*, {name}=.*leave {name} out"):
        leakfree.OffloadActivations(force_host_copy=True, **decider, **option)
    ctx = leakfree.OffloadActivations(force_host_copy=True, **decider)
    if name == "keep_small":
        with pytest.raises(ValueError, match="keep_small = .*automatic budget only"):
            ctx.keep_small = option[name]


# --- the mode, decided once ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "mode"),
    [
        ({}, "auto"),
        ({"device_budget": "auto", "keep_small": False}, "auto"),
        ({"device_budget": 0}, "device_budget"),
        ({"max_overhead": 0.05}, "max_overhead"),
        ({"device_limit": 1 << 30}, "device_limit"),
        ({"device_limit": 1 << 30, "max_overhead": 0.05}, "device_limit"),
    ],
)
def test_the_mode_is_decided_once_and_the_plan_reports_it(
    options: dict[str, Any], mode: str
) -> None:
    from leakfree.offload.options import Mode

    ctx = offload(**options)
    assert ctx.mode is Mode(mode)
    model, x = make()
    for _ in range(2):
        with ctx:
            loss = model(x).square().mean()
        loss.backward()
    assert ctx.plan is not None and ctx.plan.mode is Mode(mode)
    assert str(ctx.plan).startswith(
        {"auto": "automatic device budget", "device_budget": "device budget"}.get(mode, mode)
    )


@pytest.mark.parametrize(
    ("first", "then"),
    [
        ({"device_budget": 1 << 20}, ("max_overhead", 0.05)),
        ({"max_overhead": 0.05}, ("device_budget", 1 << 20)),
        ({"device_limit": 1 << 30}, ("keep_small", True)),
        ({"keep_small": True}, ("max_overhead", 0.05)),
        ({"max_fwd_stash_size": 2}, ("device_limit", 1 << 30)),
    ],
)
def test_which_options_combine_is_one_rule_with_one_message(
    first: dict[str, Any], then: tuple[str, Any]
) -> None:
    """The constructor and the setter refuse the same pair with the same words (after
    naming the call each way), and a refused setter changes nothing."""
    name, value = then
    with pytest.raises(ValueError) as built:
        offload(**first, **{name: value})
    ctx = offload(**first)
    before = (ctx.mode, ctx.plan, getattr(ctx, name))
    with pytest.raises(ValueError) as set_later:
        setattr(ctx, name, value)
    assert (ctx.mode, ctx.plan, getattr(ctx, name)) == before
    (other,) = first
    assert str(built.value).startswith("OffloadActivations(")
    assert str(set_later.value).startswith(f"OffloadActivations.{name} = {value!r} (with {other}=")
    assert str(built.value).partition("): ")[2] == str(set_later.value).partition("): ")[2]


def test_a_goal_set_later_after_its_auto_only_options_are_unset() -> None:
    ctx = offload(keep_small=True, max_fwd_stash_size=3)
    ctx.keep_small = None
    ctx.max_fwd_stash_size = None
    ctx.max_overhead = 0.05
    assert ctx.mode.value == "max_overhead" and ctx.max_fwd_stash_size == 5


def test_a_forward_that_keeps_everything_in_one_long_with_keeps_a_bounded_record() -> None:
    """A plan that moves nothing keeps its saved tensors as they are, recorded like copies:
    inside one ``with`` around many forwards whose graphs are dropped without backward,
    the record still ends once most of what it kept has died (without the records, the
    storage map grows by every forward's storages)."""
    model, x = make()
    ctx = offload(device_budget=1 << 30)  # everything fits: the plan moves nothing
    with ctx:
        loss = model(x).square().mean()
    loss.backward()
    assert ctx.plan is not None and ctx.plan.moved == 0
    with ctx:
        for _ in range(300):
            model(x).square().mean()  # dropped at once, without backward
            assert len(ctx._forward.kept) <= 2 * 20 + 64
