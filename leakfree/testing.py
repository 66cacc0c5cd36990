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

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from leakfree.diagnostics.memory import Growth, MemoryTracker
from leakfree.diagnostics.retention import find_retained

__all__ = ["LeakError", "assert_no_leak"]


class LeakError(AssertionError):
    """Live bytes grew per step; carries the growth and the retention report."""

    def __init__(self, message: str, growth: Growth, retained: Any) -> None:
        super().__init__(message)
        self.growth = growth
        self.retained = retained


def _roots(step_fn: Callable[..., Any], extra: Iterable[Any]) -> tuple[list[Any], list[str]]:
    roots: list[Any] = []
    names: list[str] = []
    closure = inspect.getclosurevars(step_fn) if inspect.isfunction(step_fn) else None
    if closure is not None:
        for name, value in {**closure.nonlocals, **closure.globals}.items():
            if not (inspect.ismodule(value) or inspect.isroutine(value) or inspect.isclass(value)):
                roots.append(value)
                names.append(name)
    owner = getattr(step_fn, "__self__", None)
    if owner is not None:
        roots.append(owner)
        names.append("self")
    for i, value in enumerate(extra):
        roots.append(value)
        names.append(f"root{i}")
    return roots, names


def assert_no_leak(
    step_fn: Callable[[], Any],
    *,
    steps: int = 20,
    warmup: int = 2,
    tolerance: float = 0.0,
    device: str | torch.device | None = None,
    roots: Iterable[Any] = (),
) -> Growth:
    """Fail if live memory grows per call of ``step_fn``.

    Args:
        step_fn: one training step (forward, backward, optimizer step, logging...).
        steps: measured steps after ``warmup`` unmeasured ones (caches, optimizer state).
        tolerance: bytes per step of growth accepted beyond the noise bound.
        device: the device to judge (default: the accelerator if any, else the CPU, where
            tensor storages created during the steps are tracked).
        roots: objects to search for holders when it fails (the step's closure variables,
            globals it uses and bound ``self`` are always searched).

    Returns the measured :class:`~leakfree.diagnostics.Growth`. Raises :class:`LeakError`.
    """
    if steps < 3:
        raise ValueError(f"assert_no_leak(steps={steps}): need at least 3 steps to fit a growth")
    tracker = MemoryTracker()
    with tracker:
        for _ in range(warmup + steps):
            step_fn()
            tracker.step()
    growth = tracker.growth(device, skip=warmup)
    if growth.exceeds(tolerance):
        root_list, names = _roots(step_fn, roots)
        retained = find_retained(*root_list, names=names) if root_list else find_retained()
        raise LeakError(
            f"memory grows by {growth} over {steps} steps (tolerance "
            f"{tolerance:.0f} B/step)\n\n{tracker.report(skip=warmup)}\n\nwho holds it:\n"
            f"{retained}",
            growth,
            retained,
        )
    return growth
