"""The GPU suite's gradients part: each leakfree mode's gradients, bit for bit.

Deterministic algorithms on, each mode on a fresh copy of the Llama (the same seeded
weights; one model on the device at a time) takes three steps on the same batch (a goal
measures its first, checks the second, follows its plan in the third) without an
optimizer step; the third step's gradients are compared with ``torch.equal`` against no
offloading's. ``device_limit``'s ceiling is none's held peak less 1 GiB (a fifth at small
sizes), beyond what the device held before the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from _suite_device import LEAKFREE_GOALS, Bench, context, under
from _suite_report import TimeBox

STEPS = 3


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    previous = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=warn_only)


def gradients(bench: Bench, box: TimeBox) -> dict[str, Any]:
    """Whether each of :data:`LEAKFREE_GOALS` gives ``none``'s gradients after
    :data:`STEPS` steps, at the bench's size, in ``box``."""
    out: dict[str, Any] = {"size": vars(bench.size), "steps": STEPS, "modes": {}}
    ids = bench.ids(bench.size.seq)
    with deterministic():
        model = bench.model()
        for _ in range(STEPS):
            model.zero_grad(set_to_none=True)
            step = bench.step(model, ids, contextlib.nullcontext, keep_grads=True)
        reference = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        none_held = step.held
        bench.drop(model)
        for mode in LEAKFREE_GOALS:
            if box.over():
                out["timed_out"] = f"stopped before {mode}"
                break
            out["modes"][mode] = _mode(bench, mode, ids, reference, none_held)
            box.keep(out)
    return out


def _mode(
    bench: Bench,
    mode: str,
    ids: torch.Tensor,
    reference: list[torch.Tensor],
    none_held: int,
) -> dict[str, Any]:
    model = bench.model()
    failed = False
    try:
        limit = bench.allocated() + none_held - under(none_held)
        make = context(mode, model, bench, limit=limit)
        for _ in range(STEPS):
            model.zero_grad(set_to_none=True)
            bench.step(model, ids, make, keep_grads=True)
        got = [p.grad for p in model.parameters() if p.grad is not None]
        same = len(got) == len(reference) and all(torch.equal(a, b) for a, b in zip(got, reference))
        plan = getattr(make(), "plan", None)
        return {"bit_identical": same, "plan": str(plan) if plan is not None else None}
    except Exception as e:
        failed = True
        return {"bit_identical": None, "error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        bench.drop(model)
        if failed:
            bench.after_oom()
