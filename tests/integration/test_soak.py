"""Nothing grows inside leakfree over a long run: every container a long-lived leakfree
object owns stays within a bound set at step 100, and what leakfree's own code allocated
since then and still holds does not grow (``tracemalloc``).

Each soak mixes what training loops do: shapes that change from step to step, a
``retain_graph`` backward run twice, a forward whose graph is dropped without backward,
and one kept into the next step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import leakfree
from leakfree import OffloadActivations
from leakfree.diagnostics import MemoryTracker
from tests._soak import Soak

STEPS = 4_000
#: what leakfree may allocate and still hold after step 100, beyond the most it held by
#: the middle of the run (containers rebuilt as they sweep their dead)
GROWTH = 16 << 10


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32), nn.Tanh(),
        nn.Linear(32, 4),
    )  # fmt: skip


def _train(
    steps: int,
    around: Callable[[], contextlib.AbstractContextManager[Any]],
    each: Callable[[], contextlib.AbstractContextManager[Any]],
    soak: Soak,
    roots: dict[str, object],
    after: Callable[[torch.Tensor], None] = lambda loss: None,
    reduce: leakfree.LossLog | None = None,
) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    kept = None
    with around():
        for step in range(steps):
            x = torch.randn(3 + step % 5, 16)
            with each():
                loss = model(x).square().mean()
            if step % 11 == 5:  # retain_graph, and a second backward through the same graph
                loss.backward(retain_graph=True)
                loss.backward()
            else:
                loss.backward()
            after(loss)
            opt.step()
            opt.zero_grad()
            if reduce is not None:  # every step (a log reduced every k steps is a sawtooth)
                reduce.reduce()
            if step % 7 == 3:  # a forward without backward: its graph dropped at once
                with each():
                    model(torch.randn(2, 16)).sum()
            if step % 13 == 7:  # ... or kept into the next step
                with each():
                    kept = model(torch.randn(5, 16)).sum()
            elif step % 13 == 8:
                kept = None
            if step == 100:
                soak.settle(roots)
            elif (step > 100 and step % 500 == 0) or step == steps - 1:
                soak.check(roots, step)
    del kept


@contextlib.contextmanager
def _soaked(caps: dict[str, int] | None = None) -> Iterator[Soak]:
    soak = Soak(caps)
    try:
        yield soak
    finally:
        soak.stop()
    print(f"leakfree live since step 100: {soak.where()}")
    assert soak.growth() <= GROWTH, f"leakfree's live allocations grew: {soak.where()}"


@pytest.mark.parametrize(
    "options",
    [{}, {"device_budget": 1 << 10}, {"device_budget": 1 << 20}],
    ids=["default", "budget", "budget-keeps-all"],
)
@pytest.mark.parametrize("scope", ["one-with", "with-per-step"])
def test_offloading_keeps_nothing_per_step(scope: str, options: dict[str, Any]) -> None:
    manager = OffloadActivations(force_host_copy=True, min_offload_size=0, **options)
    outer, inner = (
        (manager, contextlib.nullcontext())
        if scope == "one-with"
        else (contextlib.nullcontext(), manager)
    )
    steps = STEPS if not options else STEPS // 5
    with _soaked() as soak:
        _train(steps, lambda: outer, lambda: inner, soak, {"manager": manager})
    if options.get("device_budget") == 1 << 20:  # what a step saves fits: nothing moves
        assert manager.plan is not None and manager.plan.moved == 0
    else:
        assert manager.stats.to_host > steps  # it did offload, all along


def test_watch_losslog_and_patches_keep_nothing_per_step() -> None:
    """``watch()`` (its tracker, detector and boundaries), a ``LossLog`` reduced every
    step, and ``patch_all()``'s registries, together over a long run (the containers and
    allocations are checked by the soak as it goes); the run stays clean."""
    leakfree.patch_all()
    try:
        findings, verdict = _soak_watch_and_log()
    finally:
        leakfree.unpatch_all()  # the suite's later tests start unpatched
    assert not findings, findings
    assert verdict == "clean"


def _soak_watch_and_log() -> tuple[list[Any], str]:
    """The soak; returns the watch's findings and its verdict."""
    log = leakfree.LossLog(["lm", "aux"])
    findings: list[Any] = []
    series = MemoryTracker.MAX_POINTS + 1  # its cap (the latest value besides)
    caps = {f"watch._tracker.{name}[*]": series for name in ("series", "steps", "_numbers")}
    with leakfree.watch(on_finding=findings.append) as watch, _soaked(caps) as soak:

        def after(loss: torch.Tensor) -> None:
            log["lm"].append(loss)
            log["aux"].append(loss * 0.5)

        _train(STEPS, contextlib.nullcontext, contextlib.nullcontext, soak,
               {"watch": watch, "log": log}, after=after, reduce=log)  # fmt: skip
    return findings, watch.verdict
