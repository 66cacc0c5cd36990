"""The framework-free part of leakfree.integrations: the shared growth watcher, its options,
and imports that stay optional (the frameworks themselves: tests/integration/)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from leakfree.integrations import MemoryGrowthWarning, NotJudgedWarning
from leakfree.integrations._growth import METRIC_GROWTH, METRIC_LIVE, GrowthWatch
from leakfree.testing import LeakError
from tests._fresh import run_py


def watch(**kw: Any) -> GrowthWatch:
    options: dict[str, Any] = dict(
        warmup=1, window=4, tolerance=0.0, fail=False, device="cpu", roots=None
    )
    options.update(kw)
    return GrowthWatch("LeakfreeCallback", **options)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.kept: list[torch.Tensor] = []


def run(w: GrowthWatch, steps: int, leaky: bool) -> Model:
    model = Model()
    state = {"step": 0}
    w.start()
    try:
        for _ in range(steps):
            hidden = model.lin(torch.randn(8, 16)).tanh()
            hidden.sum().backward()
            with torch.no_grad():  # SGD by hand: torch.optim's first use imports dynamo
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
            state["step"] += 1
            if leaky:
                model.kept.append(hidden)  # the graph stays with it
            w.step(lambda: {"model": model, "state": state})
    finally:
        w.stop()
    return model


def test_growth_warns_once_naming_growth_and_holder() -> None:
    w = watch()
    with pytest.warns(MemoryGrowthWarning) as caught:
        # warm-up, four steps to suspect, two to confirm, one more
        run(w, steps=1 + 4 + 2 + 1, leaky=True)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith("LeakfreeCallback: memory grows by 512 B/step +- 0 B on cpu")
    assert "over optimizer steps 4-7 (4 steps after a 1-step warm-up" in message
    assert "model.kept[*]  7 graphs" in message
    assert "created at tests/test_integrations.py:39 in run" in message
    assert w.growth is not None and w.growth.bytes_per_step == 8 * 16 * 4
    assert w.retained and not w.active


def test_clean_loop_stays_quiet_and_reports_numbers() -> None:
    w = watch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryGrowthWarning)
        run(w, steps=1 + 4 + 3, leaky=False)
    assert w.growth is not None and not w.growth.exceeds()
    metrics = w.metrics()
    assert set(metrics) == {METRIC_LIVE, METRIC_GROWTH} and metrics[METRIC_LIVE] > 0


def test_fail_raises_and_stops_tracking() -> None:
    w = watch(fail=True, roots={"extra": []})
    with pytest.raises(LeakError, match=r"(?s)grows by.*model\.kept\[\*\]") as e:
        run(w, steps=10, leaky=True)
    assert e.value.growth.bytes_per_step == 8 * 16 * 4
    assert w.steps == 7 and not w.active  # suspected at step 5, confirmed by step 7


def test_windows_are_judged_one_by_one() -> None:
    w = watch(warmup=0)
    with pytest.warns(NotJudgedWarning, match=r"not judged: 3 of the 4 optimizer steps"):
        run(w, steps=3, leaky=False)  # a short run is said to be one, never called clean
    assert w.growth is None and w.metrics().keys() == {METRIC_LIVE}  # no full window yet
    assert (w.verdict, w.judged_steps, w.needed_steps) == ("not judged", 3, 4)
    w = watch(warmup=0, tolerance=1e9)
    run(w, steps=4 + 3 * 3, leaky=True)  # four windows sharing end points: no warning
    assert w.growth is not None and w.growth.steps == 4


def test_tracker_is_stopped_and_restarted_cleanly() -> None:
    w = watch()
    w.stop()  # idempotent before any start
    w.start()
    w.start()  # idempotent while running
    assert w.active
    w.stop()
    w.stop()
    assert not w.active
    w.step(lambda: {})  # outside start/stop: ignored
    assert w.steps == 0


@pytest.mark.parametrize(
    ("option", "value", "error"),
    [
        ("warmup", -1, r"LeakfreeCallback\(warmup=-1\): expected an int >= 0"),
        ("warmup", 1.5, r"LeakfreeCallback\(warmup=1.5\)"),
        ("window", 3, r"LeakfreeCallback\(window=3\): expected an int >= 4"),
        ("window", True, r"LeakfreeCallback\(window=True\)"),
        ("tolerance", -1.0, r"LeakfreeCallback\(tolerance=-1.0\): expected a finite"),
        ("tolerance", float("nan"), r"LeakfreeCallback\(tolerance=nan\)"),
        ("fail", "yes", r"LeakfreeCallback\(fail='yes'\): expected True or False"),
        ("device", "cdua", r"LeakfreeCallback\(device='cdua'\): not a device"),
        ("roots", "model", r"LeakfreeCallback\(roots='model'\): expected \{name: object\}"),
        ("roots", {1: []}, r"LeakfreeCallback\(roots=\.\.\.\): names must be strings"),
    ],
)
def test_bad_options_name_the_argument(option: str, value: Any, error: str) -> None:
    with pytest.raises((ValueError, TypeError), match=error):
        watch(**{option: value})


def test_imports_stay_optional() -> None:
    """``import leakfree`` and ``import leakfree.integrations`` import no framework; the
    framework modules say what to install when it is missing."""
    result = run_py(
        """
        import json, sys
        import leakfree, leakfree.integrations
        frameworks = ("transformers", "lightning", "pytorch_lightning")
        loaded = sorted(m for m in frameworks if m in sys.modules)
        for name in frameworks:
            sys.modules[name] = None  # as if not installed: importing it raises ImportError
        errors = {}
        for module in ("transformers", "lightning"):
            try:
                __import__("leakfree.integrations." + module)
            except ImportError as e:
                errors[module] = str(e)
        print(json.dumps({"loaded": loaded, "errors": errors}))
        """
    )
    assert result["loaded"] == []
    assert (
        "needs the transformers package: pip install transformers"
        in (result["errors"]["transformers"])
    )
    assert "needs Lightning: pip install lightning" in result["errors"]["lightning"]


def test_accelerator_is_read_from_its_allocator_without_a_dispatch_mode(
    accelerator: torch.device,
) -> None:
    """On an accelerator (the simulated one without a GPU) the default judges it, from
    its allocator: no storage tracker slows the step."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    w = watch(device=None, warmup=0)
    assert w.device.type == accelerator.type
    kept: list[torch.Tensor] = []
    w.start()
    try:
        assert _get_current_dispatch_mode() is None
        with pytest.warns(MemoryGrowthWarning, match=r"kept  6 tensor\(s\) without a graph"):
            for _ in range(6):  # suspected at the fourth step, what grew named at the sixth
                kept.append(torch.ones(256, device=accelerator))
                w.step(lambda: {"kept": kept})
    finally:
        w.stop()
    assert w.growth is not None and w.growth.bytes_per_step == 1024
    assert w.message is not None and "on " + str(w.device) in w.message


def test_sampled_tracking_finds_the_exact_growth_within_a_few_steps() -> None:
    # sample_every=4 tracks storages on about one step in four; the heap, read at every
    # step, suspects the growth and every step is tracked until it is confirmed: the
    # growth is the exact bytes per step, found as soon as with every step tracked.
    w = watch(warmup=0, sample_every=4)
    with pytest.warns(MemoryGrowthWarning) as record:
        run(w, steps=40, leaky=True)
    exact = watch(warmup=0)
    with pytest.warns(MemoryGrowthWarning):
        run(exact, steps=8, leaky=True)
    assert w.growth is not None and exact.growth is not None
    assert w.growth.bytes_per_step == pytest.approx(exact.growth.bytes_per_step, rel=0.05)
    assert w.findings[0].step <= 12
    assert "model.kept[*]" in str(record[0].message)
    with pytest.raises(ValueError, match=r"LeakfreeCallback\(sample_every=0\)"):
        watch(sample_every=0)


def test_growth_that_stopped_is_withdrawn_at_train_end_and_said_so() -> None:
    """A replay buffer of the last 8 tensors fills for 8 steps, then stays: warned of as
    provisional while it fills, withdrawn when training ends (the verdict is taken over
    the whole run), with a LeakfreeWarning that says how it grew and stopped."""
    import collections

    from leakfree.errors import LeakfreeWarning

    w = watch()
    model = torch.nn.Linear(16, 16)
    buffer: collections.deque[torch.Tensor] = collections.deque(maxlen=8)
    w.start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for _ in range(32):
                model(torch.randn(4, 16)).sum().backward()
                buffer.append(torch.randn(256))  # 1 KiB, no graph
                w.step(lambda: {"model": model, "buffer": buffer})
        finally:
            w.stop()
    growth = [c for c in caught if issubclass(c.category, MemoryGrowthWarning)]
    assert growth and "provisional" in str(growth[0].message)
    assert w.verdict == "clean" and w.findings == [], w.revisions
    revised = [str(c.message) for c in caught if c.category is LeakfreeWarning]
    assert revised and "then flat for" in revised[0] and "not a leak" in revised[0], revised
