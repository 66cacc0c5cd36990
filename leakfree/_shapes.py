"""The leak shapes, written once: the demo, the tests and the benchmarks build them here.

Each is the smallest code that has the shape of a real upstream leak (see
docs/catalogue.md); none is used by the library itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def context_loss(
    numel: int, on_context: Callable[[torch.Tensor], None] | None = None
) -> type[torch.autograd.Function]:
    """Fast-LLM's loss shape: a Function whose forward parks a ``numel``-float context on
    ``ctx`` (``ctx.context``) and returns ``mean(x**2)``. ``on_context`` sees each context
    tensor as it is made (to watch its lifetime). The context lives as long as the node:
    a logged loss that keeps its graph keeps it too."""

    class ContextLoss(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.context = torch.zeros(numel, device=x.device)  # leakfree: ignore[LF001]
            if on_context is not None:
                on_context(ctx.context)
            ctx.save_for_backward(x)
            return x.square().mean()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            return g * 2 * x / x.numel()  # type: ignore[no-any-return]

    ContextLoss.__qualname__ = "ContextLoss"  # as reports name the shape
    return ContextLoss
