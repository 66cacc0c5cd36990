from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import simdev

# Before any backward runs: the autograd engine sizes its device queues at its first one.
simdev.register()

# One intra-op thread, here and in every process a test starts (benchmark smoke runs,
# scripts, ranks). The suite's tensors are tiny, so threads buy nothing, and on a shared
# machine they cost everything: each parallel op waits for its slowest thread, and a busy
# core deschedules one. Measured on 2 cores beside 4 busy processes: `benchmarks/offload.py
# --quick --steps 3` took 200 s with torch's default 2 threads and 9.6 s with one (7.4 s
# quiet). Tests that need more set their own (tests/_dist.py sizes its ranks).
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


def _collect_and_freeze() -> None:
    """A full collection, then everything still alive (modules and caches that tests load
    lazily: torch._dynamo, leakfree's own) joins the permanent generation, so the next
    full collection, here or in a test, scans only what is new: 5 ms instead of 30-70."""
    gc.collect()
    gc.freeze()


@pytest.fixture
def no_gc() -> Iterator[None]:
    """Run with the cyclic collector off: what is freed here is freed by refcounting alone."""
    _collect_and_freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def sim() -> Iterator[Any]:
    """The simulated accelerator (``tests/simdev``), switched on for one test, with a stream
    sanitizer attached: any race or unsafe free it saw fails the test at teardown.

    ``sim.device`` / ``sim.module`` / ``sim.syncs`` (the host waits counted) /
    ``sim.sanitizer``; ``sim.lazy = True`` makes it a slow device whose events complete
    only when the host waits for them.
    """
    if not simdev.supported():
        pytest.skip(f"the simulated device supports torch {simdev.device.SUPPORTED} only")
    with simdev.enabled() as device, simdev.attach() as sanitizer:
        device.sanitizer = sanitizer
        yield device
        _collect_and_freeze()  # frees that the test left to the collector are checked too
    sanitizer.check()


@pytest.fixture
def accelerator(request: pytest.FixtureRequest) -> torch.device:
    """The machine's accelerator; without one, the simulated device (sanitizer on)."""
    if torch.accelerator.is_available():
        device = torch.accelerator.current_accelerator()
        assert device is not None
        return device
    sim = request.getfixturevalue("sim")
    return sim.device  # type: ignore[no-any-return]


_INTEGRATION = Path(__file__).resolve().parent / "integration"


def _integration_deselected(config: pytest.Config) -> bool:
    """Whether ``-m`` leaves out every integration test, whatever other marks it has
    (``-m "not integration"``, ``-m "not integration and not slow"``)."""
    from _pytest.mark.expression import Expression

    markexpr = config.getoption("markexpr", "") or ""
    if not markexpr:
        return False
    expression = Expression.compile(markexpr)
    return not any(
        expression.evaluate(lambda name, other=other: name == "integration" or other)
        for other in (False, True)
    )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The fast suite does not even import tests/integration/: its modules import
    transformers, Lightning and bitsandbytes (about 4 s of the fast suite's collection)."""
    if collection_path == _INTEGRATION and _integration_deselected(config):
        return True
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/integration/ is marked ``integration``: ``-m "not
    integration"`` is the fast suite."""
    for item in items:
        if _INTEGRATION in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True, scope="session")
def _frozen_heap() -> Iterator[None]:
    """Move what importing torch, transformers and the test modules made into the
    collector's permanent generation: the full collections that fixtures run per test
    then scan only what the tests made (a tenth of a second each, instead of 0.3)."""
    gc.collect()
    gc.freeze()
    _MODULES[0] = len(sys.modules)
    yield
    gc.unfreeze()


#: how many modules were loaded when the heap was last frozen
_MODULES = [0]


def pytest_runtest_teardown(item: pytest.Item) -> None:
    """A test that imported modules (``torch.compile`` loads torch._dynamo: 120,000
    objects) freezes the heap again: every full collection after it (the finders' cycle
    probe, the fixtures') would otherwise scan them all, a tenth of a second each."""
    if len(sys.modules) > _MODULES[0] + 20:
        _collect_and_freeze()
        _MODULES[0] = len(sys.modules)
