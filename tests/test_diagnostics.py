"""MemoryTracker, fit_growth and find_retained."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import leakfree
from leakfree.diagnostics import MemoryTracker, StorageTracker, find_retained, fit_growth
from tests._functions import tracked
from tests.test_losses import ContextLoss


def test_fit_growth_slope_and_noise() -> None:
    g = fit_growth([100 + 50 * i for i in range(10)])
    assert g.bytes_per_step == pytest.approx(50) and g.noise == pytest.approx(0, abs=1e-9)
    assert g.exceeds(0) and not g.exceeds(60)
    flat_noisy = fit_growth([1000, 1010, 990, 1005, 995, 1000, 1008, 992])
    assert abs(flat_noisy.bytes_per_step) < flat_noisy.noise  # noise, not growth
    assert not flat_noisy.exceeds(0)
    assert math.isinf(fit_growth([5]).noise)


def test_storage_tracker_sees_what_only_autograd_holds() -> None:
    lin = nn.Linear(256, 256)
    with StorageTracker() as tracker:
        y = torch.tanh(lin(torch.randn(64, 256)))  # TanhBackward holds its output in C++
        held = tracker.live_bytes()["cpu"]
        del y
        after = tracker.live_bytes().get("cpu", 0)
    assert held >= 2 * 64 * 256 * 4  # linear's output and tanh's output (saved by the node)
    assert after == 0


def test_tracker_growth_leaky_vs_clean() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    kept: list[Any] = []

    def step(keep: bool) -> None:
        loss = model(torch.randn(32, 64)).square().mean()
        loss.backward()
        model.zero_grad(set_to_none=False)
        if keep:
            kept.append(model[0](torch.randn(8, 64)))  # 2 KiB output, with its graph

    results = {}
    for keep in (False, True):
        tracker = tracked(lambda keep=keep: step(keep), 12, sample_every=1)
        results[keep] = tracker.growth("cpu")
        report = tracker.report()
        assert bool(tracker.findings) == keep
    assert not results[False].exceeds(0)
    # forward outputs kept, never backpropagated: named by the list that keeps them
    assert "kept[*]  8 graphs, 32.0 KiB" in report  # found at step 8: 4 to suspect, 2 to confirm
    # the kept output and the input its graph saved for the weight gradient
    assert results[True].bytes_per_step == pytest.approx(2 * 8 * 64 * 4, rel=0.01)
    assert "<- grows" in report and "cpu" in report
    with pytest.raises(KeyError, match="not tracked"):
        tracker.growth("meta")


class BatchContext:
    def __init__(self) -> None:
        self.losses: dict[str, list[torch.Tensor]] = {"lm": []}


def test_find_retained_names_the_container_path_and_ctx_attribute() -> None:
    context = BatchContext()
    w = torch.randn(16, requires_grad=True)
    for _ in range(4):
        loss = ContextLoss.apply(w * 2)
        loss.backward()
        context.losses["lm"].append(loss)
    del loss
    report = find_retained()  # the caller's locals: `context`, `w`
    paths = {r.where for r in report if r.kind == "graph"}
    assert paths == {f"context.losses['lm'][{i}]" for i in range(4)}
    ctx = [r for r in report if r.kind == "ctx attribute"]
    assert [(r.where, r.nbytes) for r in ctx] == [("ContextLoss.ctx.context", 4 * 64 * 1024 * 4)]
    assert report.total_bytes == 4 * 256 * 1024
    text = str(report)
    assert "context.losses['lm'][*]" in text and "1.0 MiB" in text  # one row for the four


def test_find_retained_clean_after_detach_and_with_leakfree() -> None:
    context = BatchContext()
    w = torch.randn(16, requires_grad=True)
    for _ in range(2):
        loss = ContextLoss.apply(w * 2)
        loss.backward()
        context.losses["lm"].append(loss.detach())
    del loss
    assert not find_retained(context, names=["context"])
    log = leakfree.LossLog(["lm"])
    log["lm"].append(ContextLoss.apply(w * 2))
    assert not find_retained(log, names=["log"])
    assert "nothing retained" in str(find_retained(log, names=["log"]))


def test_find_retained_sees_tensors_inside_objects_on_ctx() -> None:
    class Storage:
        def __init__(self, t: torch.Tensor) -> None:
            self.data = t

    class TEish(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.tensor_objects = [Storage(torch.zeros(1000))]
            return x * 2

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g * 2

    x = torch.randn(3, requires_grad=True)
    outputs = [TEish.apply(x)]
    outputs[0].sum().backward()
    report = find_retained(outputs, names=["outputs"])
    [(where, nbytes)] = [(r.where, r.nbytes) for r in report if r.kind == "ctx attribute"]
    assert where.endswith("TEish.ctx.tensor_objects") and nbytes == 4000


def _growth(step: Any, steps: int = 8) -> Any:
    tracker = MemoryTracker(devices=["cpu"], sample_every=1, warn=False)
    with tracker:
        for _ in range(steps):
            step()
            tracker.step()
    return tracker.growth("cpu")


def test_tracker_sees_torch_tensor_of_a_list_and_current_sizes() -> None:
    kept: list[torch.Tensor] = []
    g = _growth(lambda: kept.append(torch.tensor([1.0] * 256)))
    assert g.bytes_per_step == pytest.approx(1024) and g.exceeds(0)

    grow = torch.empty(0)

    def resize() -> None:
        grow.untyped_storage().resize_(grow.untyped_storage().nbytes() + 4096)

    def fresh() -> None:  # created inside the tracker, then grown in place every step
        nonlocal grow
        if grow.numel() == 0 and not kept_resized:
            grow = torch.zeros(1)
            kept_resized.append(grow)
        resize()

    kept_resized: list[torch.Tensor] = []
    assert _growth(fresh).bytes_per_step == pytest.approx(4096)

    released: list[torch.Tensor] = []

    def keep_then_free() -> None:  # what release_output does: the object stays, memory goes
        t = torch.zeros(64 * 1024)
        t.untyped_storage().resize_(0)
        released.append(t)

    assert not _growth(keep_then_free).exceeds(0)


def test_growth_ignores_a_one_off_jump() -> None:
    assert not fit_growth([0] * 5 + [1 << 20] * 5).exceeds(0)
    assert fit_growth([i * 1000 for i in range(10)]).exceeds(0)


def test_find_retained_never_runs_unpack_hooks_nor_properties() -> None:
    calls: list[int] = []
    x = torch.randn(8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: t.clone(), lambda t: (calls.append(1), t)[1]
    ):
        y = (x * x).sum()

    class Flaky:
        __slots__ = ("conn", "value")

        def __init__(self, value: torch.Tensor) -> None:
            self.value = value

    holder = Flaky(y)  # `conn` is never set: reading it raises
    report = find_retained(holder, names=["holder"])
    assert calls == [] and not report  # not backpropagated yet: nothing to report
    y.backward()
    assert calls == [1, 1]
    assert not find_retained(holder, names=["holder"])  # one graph in a slot: quiet
    report = find_retained(holder, names=["holder"], everything=True)
    assert [r.where for r in report if r.kind == "graph"] == ["holder.value"]
    assert calls == [1, 1]  # the walk unpacked nothing


# --- what find_retained charges, and to whom -------------------------------------------------


def test_find_retained_charges_a_pinned_leaf_and_its_grad() -> None:
    lin = nn.Linear(64, 64)
    kept = []
    for _ in range(2):
        x = torch.randn(32, 64, requires_grad=True)  # a per-step leaf (an input needing grad)
        loss = lin(x).square().mean()
        loss.backward()
        kept.append(loss)  # its graph's AccumulateGrad holds x, and x holds x.grad
    ref = StorageWeakRef(x.grad.untyped_storage())  # type: ignore[union-attr,no-untyped-call]
    del x, loss
    assert not ref.expired()  # alive through the kept graph only
    report = find_retained(kept, lin, names=["kept", "lin"])
    leaf = 32 * 64 * 4
    # the loss (4 B), the leaf and its .grad; lin's parameters and their grads live anyway
    assert {r.where: r.nbytes for r in report} == {"kept[0]": 4 + 2 * leaf, "kept[1]": 4 + 2 * leaf}
    kept.clear()
    assert ref.expired()


def test_find_retained_leaf_held_elsewhere_is_not_charged_twice() -> None:
    w = torch.randn(1024, requires_grad=True)  # a leaf the caller holds: it lives anyway
    kept = []
    for _ in range(2):
        loss = (w * 2).sum()
        loss.backward()
        kept.append(loss)
    report = find_retained(kept, w, names=["kept", "w"])
    assert {r.where: r.nbytes for r in report} == {"kept[0]": 4, "kept[1]": 4}


class Registry:
    entries: list[Any] = []  # a class-level list: shared by instances, lives with the class


class Trainer(Registry):
    def __init__(self) -> None:
        self.steps = 0


def test_find_retained_walks_class_attributes() -> None:
    trainer = Trainer()
    w = torch.randn(16, requires_grad=True)
    try:
        for _ in range(3):
            loss = (w * 3).sum()
            loss.backward()
            Registry.entries.append({"loss": loss})
        del loss
        report = find_retained(trainer, names=["trainer"])
        assert sorted(r.where for r in report) == [
            f"Registry.entries[{i}]['loss']" for i in range(3)
        ]
    finally:
        Registry.entries.clear()


def test_find_retained_explains_detached_growth() -> None:
    model = nn.Linear(64, 64)
    model.history = []  # type: ignore[assignment]
    opt = torch.optim.Adam(model.parameters())
    for _ in range(5):
        out = model(torch.randn(16, 64))
        out.square().mean().backward()
        opt.step()
        model.history.append({"out": out.detach()})  # type: ignore[operator]
    del out
    assert not find_retained(model, opt, names=["model", "opt"]).detached  # quiet by default
    report = find_retained(model, opt, names=["model", "opt"], everything=True)
    assert not report  # nothing backward should have freed
    [held] = report.detached  # not the parameters, nor the optimizer's state
    # the container, and the field of its items that holds the tensors
    assert (held.where, held.nbytes) == ("model.history[*]['out']", 5 * 16 * 64 * 4)
    assert held.detail.startswith("5 tensor(s)")
    text = str(report)
    assert text.startswith("nothing retained") and "no graph kept; 20.0 KiB" in text
    model.history.append({"out": torch.zeros(16, 64)})  # type: ignore[operator]
    [again] = find_retained(model, opt, names=["model", "opt"], since=report).detached
    assert again.count == 6
    assert again.detail.endswith("growing: +1 tensors, +4.0 KiB since the last report")


def test_find_retained_does_not_flag_parameters_saved_on_ctx() -> None:
    class QuantLinear(torch.autograd.Function):  # bitsandbytes' MatMul4Bit keeps its weight
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, state: Any) -> torch.Tensor:
            ctx.state = state  # the weight's quantization state: lives with the weight
            ctx.tensors = (None, weight.view(-1, 1))  # a view of the parameter
            ctx.scratch = torch.zeros(100)  # truly kept only by the ctx
            return x @ weight.t()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> Any:
            _, w = ctx.tensors
            return g @ w.view(8, 8), None, None

    class Quantized(nn.Parameter):  # like Params4bit: a Parameter subclass, frozen
        pass

    weight = Quantized(torch.randn(8, 8), requires_grad=False)
    weight.quant_state = {"absmax": torch.ones(64)}  # type: ignore[attr-defined]
    x = torch.randn(4, 8, requires_grad=True)
    out = QuantLinear.apply(x, weight, weight.quant_state)  # type: ignore[attr-defined]
    out.sum().backward()
    del weight  # only the graph holds the parameter now: still a parameter, not charged
    report = find_retained([out], names=["kept"])
    ctx = [(r.where.rsplit(".", 3)[-3:], r.nbytes) for r in report if r.kind == "ctx attribute"]
    assert ctx == [(["QuantLinear", "ctx", "scratch"], 400)]


def test_sampled_tracking_measures_the_same_growth_per_step() -> None:
    kept: list[torch.Tensor] = []
    w = torch.randn(64, 64)
    on_steps: list[bool] = []

    def step(keep: bool) -> None:
        on_steps.append(torch._C._len_torch_dispatch_stack() > 0)
        out = torch.tanh(torch.randn(16, 64) @ w)
        if keep:
            kept.append(out)  # 4 KiB per step

    results = {}
    for keep in (False, True):
        on_steps.clear()
        tracker = tracked(lambda keep=keep: step(keep), 64, sample_every=4)
        results[keep] = tracker.growth("cpu")
        steps = tracker.steps["cpu"]
        assert steps == [i for i, on in enumerate(on_steps) if on]  # one value per tracked step
        assert steps[0] == 0
        if not keep:  # the leak is confirmed by tracking every step for a while
            assert 8 <= len(steps) <= 32 and " of 64" in tracker.report()
    assert results[True].bytes_per_step == pytest.approx(16 * 64 * 4) and results[True].exceeds(0)
    assert not results[False].exceeds(0)
    with pytest.raises(ValueError, match="sample_every"):
        MemoryTracker(sample_every=0)


def test_sampling_never_pops_another_mode() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Other(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            return func(*args, **(kwargs or {}))

    tracker = MemoryTracker(devices=["cpu"], sample_every=8)
    with tracker, Other():  # entered inside the tracker, alive at every step(): no toggling
        for _ in range(6):
            torch.ones(4)
            tracker.step()
    assert tracker.steps["cpu"] == list(range(6))
    assert torch._C._len_torch_dispatch_stack() == 0


def test_without_a_heap_count_every_step_is_tracked_until_the_run_is_judged_clean(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the C library keeps no count of the heap (not glibc), nothing cheap judges the
    untracked steps: the tracker follows every step until a verdict, then one in k."""
    import leakfree.diagnostics.memory as memory

    monkeypatch.setattr(memory, "heap_counter", lambda: None)
    tracked: list[bool] = []
    tracker = MemoryTracker(devices=["cpu"], sample_every=8, warn=False)
    with tracker:
        for _ in range(40):
            tracked.append(torch._C._len_torch_dispatch_stack() > 0)
            torch.tanh(torch.randn(16, 64))
            tracker.step()
    judged_at = tracker.detector.rule.warmup + tracker.detector.needed_steps  # a verdict
    assert all(tracked[:judged_at]) and not all(tracked[judged_at:])
    assert tracker.detector.verdict == "clean"


def test_the_heap_count_sees_cpu_tensors() -> None:
    from leakfree.diagnostics.heap import heap_counter

    count = heap_counter()
    if count is None:
        pytest.skip("no glibc heap count here: the tracker follows storages exactly")
    before = count()
    kept = torch.empty(1 << 20, dtype=torch.uint8)
    assert count() - before >= 1 << 20
    del kept
    assert count() - before < 1 << 19


def test_a_tracker_kept_for_a_whole_run_holds_a_bounded_evenly_spread_series() -> None:
    """``series`` and ``steps`` hold at most ``MAX_POINTS`` values per device, spread
    evenly over the run with the latest last, and the growth fitted from them is the same
    (a 4 KiB/step leak is 4 KiB/step after the series halved itself many times)."""
    kept = []
    w = torch.randn(64, 64)
    tracker = MemoryTracker(devices=["cpu"], sample_every=1, warn=False, microbatches=False)
    tracker.MAX_POINTS = 16
    with tracker:
        for _ in range(300):
            kept.append(torch.tanh(torch.randn(16, 64) @ w))  # 4 KiB per step
            tracker.step()
    steps = tracker.steps["cpu"]
    assert len(steps) <= 17 and len(tracker.series["cpu"]) == len(steps)
    assert steps[0] == 0 and steps[-1] == 299
    gaps = {b - a for a, b in itertools.pairwise(steps[:-1])}
    assert len(gaps) == 1  # evenly spaced, besides the latest
    assert tracker.growth("cpu").bytes_per_step == pytest.approx(16 * 64 * 4)
    assert "300" in tracker.report()
