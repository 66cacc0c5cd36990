"""Test Functions and scenarios more than one test file needs, written once."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def parking(base: type = torch.autograd.Function, numel: int = 100) -> Any:
    """A Function of ``base`` that parks ``numel`` zeros on ``ctx.big`` (saving nothing for
    backward) and doubles its input: the ctx leak in its smallest shape."""

    class Parks(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.big = torch.zeros(numel)
            return x * 2

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g * 2

    return Parks


def raise_in_the_body(ctx: Any, model: torch.nn.Module, x: torch.Tensor) -> None:
    """A forward under ``ctx`` whose ``with`` body raises before any backward: the graph
    it built is dropped with the exception."""
    with pytest.raises(RuntimeError, match="boom"), ctx:
        loss = model(x).square().mean()
        raise RuntimeError("boom")
    del loss


def tracked(step: Any, steps: int, **options: Any) -> Any:
    """``steps`` calls of ``step`` under a CPU ``MemoryTracker(**options)`` (no warnings),
    a tracker step after each; the tracker."""
    from leakfree.diagnostics import MemoryTracker

    tracker = MemoryTracker(devices=["cpu"], warn=False, **options)
    with tracker:
        for _ in range(steps):
            step()
            tracker.step()
    return tracker
