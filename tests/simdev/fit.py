"""What a user can train under a device's memory: the longest sequence and the largest
batch that train a step of the H100 run's Llama without running out of memory, for each
way of saving memory, under a cap on what the device holds.

The cap is the caching allocator's, as ``torch.cuda.set_per_process_memory_fraction`` sets
it: on *reserved* bytes (parameters, activations, gradients, the allocator's spare), so a
mode trains a length only if everything it holds fits. Each length is tried on a fresh
model, dry (shapes only, :mod:`tests.simdev.predict`), for a few steps (a goal's plan is
made from its first): it trains if none of them runs out of memory, and its last step is
timed on the H100 model. The search over lengths (steps of ``step`` tokens) and batches
is a bisection: a mode that trains a length trains every shorter one.

Every number is predicted (no GPU ran it).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import device as _device
from . import predict, timing

GiB = 1 << 30

#: the ways of saving memory the table compares, by name
MODES = (
    "none",
    "save_on_cpu",
    "trl class",
    "trl manager",
    "leakfree default",
    "max_overhead=0.05",
    "device_limit=cap",
    "checkpoint",
    "checkpoint + leakfree",
)


@dataclass(frozen=True)
class Fit:
    """How far one mode goes under one cap: the longest sequence (at ``batch``) and the
    largest batch (at ``seq``) that train, each with its step's seconds per token (None:
    not even the shortest trains)."""

    mode: str
    cap: int
    longest: int
    longest_per_token: float | None
    largest_batch: int
    batch_per_token: float | None


def _context(mode: str, model: torch.nn.Module, cap: int) -> Callable[[], Any]:
    """The context of one step of ``mode`` (``checkpoint*`` also turns on the model's
    per-layer checkpointing)."""
    if mode in ("none", "checkpoint"):
        return contextlib.nullcontext
    if mode == "save_on_cpu":
        return lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)
    if mode == "trl class":
        from trl.models.activation_offloading import OffloadActivations

        trl_ctx = OffloadActivations()
        return lambda: trl_ctx
    if mode == "trl manager":
        return predict._context("trl", model, None)
    if mode in ("leakfree default", "checkpoint + leakfree"):
        return predict.leakfree_context(model)
    if mode == "max_overhead=0.05":
        return predict.leakfree_context(model, max_overhead=0.05)
    if mode == "device_limit=cap":
        return predict.leakfree_context(model, device_limit=cap)
    raise ValueError(f"mode {mode!r}: unknown")


@contextlib.contextmanager
def _capped(sim: _device.SimDevice, cap: int) -> Iterator[None]:
    sim.module.empty_cache()
    sim.limit = cap
    try:
        yield
    finally:
        sim.limit = None


def trains(
    sim: _device.SimDevice,
    mode: str,
    *,
    cap: int,
    batch: int,
    seq: int,
    steps: int = 3,
    layers: int = 8,
) -> float | None:
    """The seconds of the last of ``steps`` steps of ``mode`` at ``batch`` x ``seq`` on a
    fresh model under ``cap`` held bytes, or None where one ran out of memory."""
    sim.module.empty_cache()
    model = predict.llama(sim.device, layers)
    if mode.startswith("checkpoint"):
        model.gradient_checkpointing_enable({"use_reentrant": False})
    ids = torch.zeros(batch, seq, dtype=torch.long, device=sim.device)
    context: Callable[[], Any] = contextlib.nullcontext
    seconds: float | None = None
    try:
        with _capped(sim, cap):
            context = _context(mode, model, cap)
            # every step on the timing model: a goal's measured step times its forward
            # and its copies there (untimed, it would plan from a step that took no time)
            for _ in range(steps - 1):
                with timing.attach(timing.H100):
                    predict._step(sim, model, ids, context)
            with timing.attach(timing.H100) as t:
                predict._step(sim, model, ids, context)
            seconds = t.end
    except torch.OutOfMemoryError:
        pass  # (cleaned up below, once the error and its frames are gone)
    _pop_hooks()
    _clear_trl(context())
    for p in model.parameters():
        p.grad = None
    model.to_empty(device="meta")
    del model, ids, context
    gc.collect()
    sim.module.empty_cache()
    if sim.allocated():
        # The next try must start from an empty device. What is left after a step that
        # ran out of memory in backward is in the simulated allocator's count alone (no
        # device storage is alive: tests/simdev/NOTES.md): a new allocator, as a new
        # process would have.
        _device._STATE.allocators = _device._STATE.new_allocators()
    return seconds


def _pop_hooks() -> None:
    """Saved-tensor hooks a step left installed: TRL's head, run under its ``NoOpManager``
    by module hooks, pushes it in a forward pre-hook and pops it in a forward hook, which a
    forward that ran out of memory never reaches (leakfree's ``offload_model`` registers
    that one with ``always_call=True``); every later save of the process would go
    through it."""
    autograd = torch._C._autograd
    while autograd._top_saved_tensors_default_hooks(False) is not None:
        autograd._pop_saved_tensors_default_hooks()


def _clear_trl(ctx: Any) -> None:
    """TRL's offloader keeps what its side tables hold after a step that ran out of
    memory (until its next ``__enter__``): a user's run ends there, so the next try must
    not pay for it."""
    if type(ctx).__module__.startswith("trl."):
        for table in vars(ctx).values():  # tracker, its stashes, its storage keys
            if isinstance(table, dict):
                table.clear()


def _bisect(ok: Callable[[int], float | None], low: int, high: int) -> tuple[int, float | None]:
    """The largest ``k`` in ``[low, high]`` for which ``ok(k)`` is not None (0 if none),
    and its value: ``ok`` holds for every ``k`` under one it holds for."""
    best, value = 0, None
    while low <= high:
        mid = (low + high) // 2
        got = ok(mid)
        if got is None:
            high = mid - 1
        else:
            best, value = mid, got
            low = mid + 1
    return best, value


def fit(
    sim: _device.SimDevice,
    mode: str,
    cap: int,
    *,
    step: int = 512,
    longest: int = 16384,
    batch: int = 2,
    seq: int = 4096,
    largest: int = 8,
    layers: int = 8,
) -> Fit:
    """``mode``'s :class:`Fit` under ``cap``: lengths in steps of ``step`` up to
    ``longest`` at ``batch``, and batches up to ``largest`` at ``seq``."""
    units, per = _bisect(
        lambda k: trains(sim, mode, cap=cap, batch=batch, seq=k * step, layers=layers),
        1,
        longest // step,
    )
    batches, per_batch = _bisect(
        lambda b: trains(sim, mode, cap=cap, batch=b, seq=seq, layers=layers), 1, largest
    )
    return Fit(
        mode,
        cap,
        units * step,
        per / (batch * units * step) if per is not None else None,
        batches,
        per_batch / (batches * seq) if per_batch is not None else None,
    )


def caps(sim: _device.SimDevice, *, layers: int = 8) -> list[int]:
    """The caps of the table: what no offloading holds at batch 2 x 4096 (parameters
    included), and three quarters and half of it."""
    sim.module.empty_cache()
    held = predict.predict(sim, "none", layers=layers).held_peak
    sim.module.empty_cache()
    model = predict.llama(sim.device, layers)
    params = sim.reserved()
    model.to_empty(device="meta")
    full = params + held
    return [full, full * 3 // 4, full // 2]
