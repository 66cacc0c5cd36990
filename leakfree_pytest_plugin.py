"""leakfree's pytest plugin: the ``leak_check`` fixture and marker (entry point ``leakfree``).

Loaded in every test session of an environment where leakfree is installed, so it lives
outside the ``leakfree`` package and imports nothing heavy (not even torch) until a test
uses it:

* ``leak_check`` fixture: ``leak_check(step_fn, steps=20, tolerance=0)`` is
  :func:`leakfree.testing.assert_no_leak`;
* ``@pytest.mark.leak_check(steps=10, warmup=2, tolerance=0)``: the test function is the
  step, run ``warmup + steps`` times; the test fails if live memory grows per run.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

_OPTIONS = ("steps", "warmup", "tolerance", "device")


def pytest_configure(config: Any) -> None:
    config.addinivalue_line(
        "markers",
        "leak_check(steps=10, warmup=2, tolerance=0, device=None): run the test as a step "
        "repeatedly and fail if live memory grows per run (leakfree)",
    )


@pytest.fixture
def leak_check() -> Callable[..., Any]:
    """``leak_check(step_fn, steps=20, tolerance=0)``: leakfree's ``assert_no_leak``."""
    from leakfree.testing import assert_no_leak

    return assert_no_leak


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: Any) -> bool | None:
    marker = pyfuncitem.get_closest_marker("leak_check")
    if marker is None:
        return None  # not ours: pytest calls the test as usual
    func = pyfuncitem.obj
    if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
        raise pytest.UsageError(
            f"{pyfuncitem.nodeid}: @pytest.mark.leak_check cannot repeat an async test; call "
            "leak_check(step) (the fixture) with a synchronous step instead"
        )
    unknown = [k for k in marker.kwargs if k not in _OPTIONS]
    if marker.args or unknown:
        raise pytest.UsageError(
            f"{pyfuncitem.nodeid}: @pytest.mark.leak_check takes keyword arguments "
            f"{', '.join(_OPTIONS)}; got {marker.args!r} {unknown!r}"
        )
    from leakfree.testing import assert_no_leak

    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    options = {"steps": 10, **marker.kwargs}
    assert_no_leak(lambda: func(**kwargs), **options)
    return True  # the test ran, as the measured step
