"""MemoryTracker, fit_growth and find_retained."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import leakfree
from leakfree.diagnostics import MemoryTracker, StorageTracker, find_retained, fit_growth
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
        tracker = MemoryTracker(devices=["cpu"])
        with tracker:
            for _ in range(12):
                step(keep)
                tracker.step()
        results[keep] = tracker.growth("cpu")
        report = tracker.report()
    assert not results[False].exceeds(0)
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
    assert "context.losses['lm'][3]" in text and "1.0 MiB" in text


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
    tracker = MemoryTracker(devices=["cpu"])
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
    report = find_retained(holder, names=["holder"])
    assert [r.where for r in report if r.kind == "graph"] == ["holder.value"]
    assert calls == [1, 1]  # the walk unpacked nothing
