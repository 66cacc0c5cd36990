"""assert_no_leak and the pytest plugin (leak_check fixture and marker)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from leakfree.testing import LeakError, assert_no_leak

pytest_plugins = ["pytester"]


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def test_catches_a_planted_leak_and_says_who_holds_it() -> None:
    model, opt = _model()
    history: list[torch.Tensor] = []

    def step() -> None:
        loss = model(torch.randn(16, 32)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        history.append(loss)  # the planted leak: a logged loss with its graph

    with pytest.raises(LeakError) as err:
        assert_no_leak(step, steps=10)
    assert err.value.growth.bytes_per_step > 0
    message = str(err.value)
    assert "memory grows by" in message and "history[*]  8 graphs" in message
    # the line that made the retained loss, in the step that made it
    assert "created at tests/test_testing.py:27 in test_catches_a_planted_leak" in message


@pytest.mark.parametrize("run", range(20))
def test_clean_loop_never_a_false_alarm(run: int) -> None:
    model, opt = _model(seed=run)  # a different model and different data every run
    logged: list[float] = []

    def step() -> None:
        x = torch.randn(16, 32)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=run % 2 == 0)
        logged.append(loss.item())

    growth = assert_no_leak(step, steps=10)
    assert growth.bytes_per_step - growth.noise <= 0


def test_tolerance_and_argument_errors() -> None:
    buf: list[torch.Tensor] = []
    assert_no_leak(lambda: buf.append(torch.zeros(4)), steps=5, tolerance=64)  # 16 B/step
    with pytest.raises(ValueError, match="steps=2"):
        assert_no_leak(lambda: None, steps=2)


#: the inner runs load the installed plugins that pyproject.toml's addopts switch off
#: for the suite itself (hypothesis alone costs a third of a second per run)
_QUIET_PLUGINS = ("-p", "no:hypothesispytest", "-p", "no:anyio", "-p", "no:benchmark")


def test_pytest_plugin_fixture_and_marker(pytester: Any) -> None:
    pytester.makepyfile(
        """
        import pytest, torch

        KEPT = []

        def test_fixture_catches(leak_check):
            with pytest.raises(AssertionError, match="memory grows"):
                leak_check(lambda: KEPT.append(torch.zeros(256)), steps=5)

        @pytest.mark.leak_check(steps=5)
        def test_marker_clean():
            torch.randn(64, 64) @ torch.randn(64, 64)

        @pytest.mark.leak_check(steps=5)
        def test_marker_leaky():
            KEPT.append(torch.zeros(1024))
        """
    )
    result = pytester.runpytest(
        "-q", *_QUIET_PLUGINS
    )  # the plugin is loaded through its entry point
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*test_marker_leaky*", "*memory grows by 4.0 KiB/step*"])


def test_pytest_plugin_refuses_what_it_cannot_repeat(pytester: Any) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.leak_check(5)
        def test_positional():
            pass

        @pytest.mark.leak_check(steps=5)
        async def test_async():
            raise AssertionError("never awaited")
        """
    )
    result = pytester.runpytest("-q", *_QUIET_PLUGINS)
    result.stdout.fnmatch_lines(["*takes keyword arguments*"])
    assert result.ret != 0


def test_plugin_module_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, leakfree_pytest_plugin; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False"


# --- look where the step keeps things ---------------------------------------------------------

_TRAINING_MODULE = """
import functools
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(32, 32)
kept = []


def train_step(batch):
    loss = model(batch).square().mean()
    loss.backward()
    kept.append(loss)  # README's leak: a module global holds each loss and its graph


class Trainer:
    def __init__(self):
        self.history = []

    def step(self, batch):
        loss = model(batch).square().mean()
        loss.backward()
        self.history.append(loss)


def run(step, batch):
    step(batch)
"""


def _training_module() -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "user_training"}
    exec(compile(_TRAINING_MODULE, "user_training.py", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("how", ["lambda", "partial", "bound method", "through a helper"])
def test_assert_no_leak_finds_what_the_step_keeps_in_globals_and_objects(how: str) -> None:
    import functools

    ns = _training_module()
    batch = torch.randn(8, 32)
    trainer = ns["Trainer"]()
    step, holder = {
        "lambda": (lambda: ns["train_step"](batch), "kept["),
        "partial": (functools.partial(ns["train_step"], batch), "kept["),
        "bound method": (functools.partial(trainer.step, batch), "self.history["),
        "through a helper": (functools.partial(ns["run"], ns["train_step"], batch), "kept["),
    }[how]
    with pytest.raises(LeakError) as err:
        assert_no_leak(step, steps=6)
    # Named as the code names it: `kept[0]`, or `ns['kept'][0]` when the test's own
    # closure reaches it first through the namespace dict.
    assert holder in str(err.value).replace("ns['kept']", "kept"), str(err.value)


def test_code_roots_names_what_user_code_reaches_and_follows_no_library() -> None:
    """The one search of a step's code (diagnostics.roots.code_roots, beside the walker
    it reuses for partials and methods): the user's functions are followed, the standard
    library's and installed packages' are not (``json.dumps``'s module-level encoder is
    no holder of the user's)."""
    import functools
    import json

    from leakfree.diagnostics.roots import code_roots

    ns = _training_module()
    trainer = ns["Trainer"]()
    batch = torch.randn(2, 32)
    found = code_roots(functools.partial(ns["run"], trainer.step, batch))
    assert found["partial.args[1]"] is batch
    assert found["self"] is trainer
    assert found["model"] is ns["model"]  # a global of Trainer.step, reached through run
    assert code_roots(functools.partial(json.dumps, [1])) == {"partial.args[0]": [1]}


def test_pytest_marker_names_the_global_the_test_appends_to(pytester: Any) -> None:
    pytester.makepyfile(
        """
        import pytest, torch

        w = torch.randn(64, requires_grad=True)
        losses = []

        @pytest.mark.leak_check(steps=5)
        def test_appends_to_a_global():
            loss = (w * 2).square().sum()
            loss.backward()
            losses.append(loss)
        """
    )
    result = pytester.runpytest("-q", *_QUIET_PLUGINS)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*memory grows by*", "*losses[[]*[]]  7 graphs*"])
