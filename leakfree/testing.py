"""Leak assertions for test suites, and a pytest plugin.

``assert_no_leak(step_fn, steps=20)`` runs a step repeatedly under a
:class:`~leakfree.diagnostics.MemoryTracker` and fails, with the growth per step and a
:func:`~leakfree.diagnostics.find_retained` report of who holds the memory, when live bytes
grow faster than ``tolerance`` by more than noise can explain.

The pytest plugin (the top-level module ``leakfree_pytest_plugin``, registered as the
``leakfree`` entry point, active once leakfree is installed) adds the ``leak_check``
fixture and the ``@pytest.mark.leak_check(steps=10, tolerance=0)`` marker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

import leakfree._args as _args
from leakfree.diagnostics.detector import Rule
from leakfree.diagnostics.growth import Growth
from leakfree.diagnostics.memory import MemoryTracker, default_devices
from leakfree.diagnostics.retention import RetentionReport
from leakfree.diagnostics.roots import code_roots, judged_device
from leakfree.errors import LeakError

__all__ = ["LeakError", "assert_no_leak"]


def assert_no_leak(
    step_fn: Callable[[], Any],
    *,
    steps: int = 20,
    warmup: int | None = None,
    tolerance: float | None = None,
    floor: float | None = None,
    device: str | torch.device | None = None,
    roots: Iterable[Any] = (),
) -> Growth:
    """Fail if ``step_fn`` leaks: memory that grows per call, or builds up per backward.

    Args:
        step_fn: one training step (forward, backward(s), optimizer step, logging...).
        steps: measured steps after ``warmup`` unmeasured ones (caches, optimizer state).
        tolerance: bytes per step of growth accepted beyond the noise bound.
        floor: bytes per step of growth accepted when no autograd graph holds it
            (detached values: a loss history of a few scalars per step is no leak).
        device: the device to judge (default: the accelerator if any, else the CPU, where
            tensor storages created during the steps are tracked, every step).
        roots: objects to search for holders when it fails. Always searched: the closure
            variables and globals of ``step_fn`` and of every function of yours it reaches
            (through names it calls, lambdas, ``functools.partial``, bound methods and
            their ``self``), so a step that appends to a module global is reported as
            ``kept[3]``; the user's module globals; the locals of the calling frames.

    The rule is the detector's (:mod:`leakfree.diagnostics.detector`): growth that holds
    autograd graphs fails whatever its size, other growth above ``floor``; graphs kept
    for several microbatches within a step fail at once (``step_fn`` calls backward more
    than once); tensors held only by reference cycles fail, naming the cycle.

    Returns the measured :class:`~leakfree.diagnostics.Growth`. Raises :class:`LeakError`
    with each finding (holder, size, creation site).
    """
    _args.function("assert_no_leak", "step_fn", step_fn)
    _args.count("assert_no_leak", "steps", steps, 4, unit="steps: a growth needs 4 to fit")
    rule = Rule.of("assert_no_leak", warmup=warmup, window=steps, tolerance=tolerance, floor=floor)
    warmup = rule.warmup
    extra = _args.items("assert_no_leak", "roots", roots, expected="objects to search")

    def named() -> dict[str, Any]:
        found = code_roots(step_fn)
        for i, value in enumerate(extra):
            found.setdefault(f"root{i}", value)
        return found

    tracker = MemoryTracker(
        devices=[judged_device("assert_no_leak", device)]
        if device is not None
        else default_devices(),
        sample_every=1,
        rule=rule,
        roots=named,
        warn=False,
        owner="assert_no_leak",
    )
    tracker.detector.provisional = False  # it stops at its first finding: not revised
    with tracker:
        for _ in range(warmup + steps):
            step_fn()
            tracker.step()
            if tracker.findings:  # found: the steps left would only repeat it
                break
        else:
            tracker.detector.finish()
    growth = tracker.growth(device, skip=warmup)
    findings = tracker.findings
    if findings:
        holders = [h for f in findings for h in f.holders]
        raise LeakError(
            "\n\n".join(f.message for f in findings)
            + f"\n\n{tracker.report(skip=warmup, findings=False)}",
            findings[0].growth or growth,
            RetentionReport(holders),
        )
    return growth
