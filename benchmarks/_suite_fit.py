"""The GPU suite's fit part: the longest sequence each mode trains under a cap.

The cap is what no offloading holds at batch 2 x 4096, parameters included (the
parameters' reserved bytes on an emptied cache, plus none's held peak of a step from an
emptied cache after two warm ones: ``tests/simdev/fit.py``'s ``caps``), set with
``set_per_process_memory_fraction``, a cap on reserved bytes as a real run meets it.
Under it, for none, the leakfree default, ``device_limit=cap`` and per-layer
checkpointing: the longest sequence (steps of 512 tokens, up to a bound, by bisection:
a mode that trains a length trains every shorter one) that trains three steps (a goal
measures its first) without ``torch.OutOfMemoryError``, each try on a fresh model, the
device cleaned after each (hooks left pushed, bytes left allocated: both reported). The
fraction is set back to the whole device at the end, whatever happens.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable
from typing import Any

import torch
from _suite_device import Bench, context
from _suite_report import TimeBox

MODES = ("none", "default", "device_limit=cap", "checkpoint")
STEPS = 3


class TimeUp(Exception):
    """The part's time ran out during the search."""


def fit(bench: Bench, box: TimeBox, *, step: int = 512, longest: int = 12288) -> dict[str, Any]:
    """Each of :data:`MODES`' longest sequence under the cap (see the module doc), in
    ``box`` (what it has is kept after each try; out of time, the mode searched keeps the
    longest it trained and the others are left out)."""
    cap, params = _cap(bench)
    out: dict[str, Any] = {"cap_bytes": cap, "parameter_bytes": params, "step": step}
    out.update(longest_bound=longest, steps_per_try=STEPS, reentrant=bench.reentrant, modes={})
    try:
        for mode in MODES:
            result: dict[str, Any] = {"tries": []}
            out["modes"][mode] = result
            try:
                _search(bench, mode, cap, step, longest, result, lambda: box.keep(out), box)
            except TimeUp:
                out["timed_out"] = f"stopped during {mode}"
                result["incomplete"] = True
                break
    finally:
        bench.cap(None)
    return out


def _search(
    bench: Bench,
    mode: str,
    cap: int,
    step: int,
    longest: int,
    result: dict[str, Any],
    keep: Callable[[], None],
    box: TimeBox,
) -> None:
    """The bisection of one mode: ``result`` gets each try as it ends (``keep()`` after
    each) and the longest sequence trained, also when the time runs out."""
    tries: list[dict[str, Any]] = result["tries"]

    def attempt(k: int) -> float | None:
        seconds = _trains(bench, mode, cap, k * step, tries, box)
        keep()
        return seconds

    try:
        _bisect(attempt, longest // step)
    finally:
        trained = [t for t in tries if t["trained"]]
        best = max(trained, key=lambda t: t["seq"], default=None)
        result["longest_seq"] = best["seq"] if best else 0
        if best is not None:
            result["us_per_token"] = best["step_s"] / (bench.size.batch * best["seq"]) * 1e6


def _cap(bench: Bench) -> tuple[int, int]:
    """(the cap, the parameters' reserved bytes)."""
    bench.empty_cache()
    model = bench.model()
    bench.empty_cache()
    params = bench.reserved()
    ids = bench.ids(bench.size.seq)
    for _ in range(2):
        bench.step(model, ids, contextlib.nullcontext)
    bench.empty_cache()
    held = bench.step(model, ids, contextlib.nullcontext).held
    bench.drop(model)
    return params + held, params


def _trains(
    bench: Bench,
    mode: str,
    cap: int,
    seq: int,
    tries: list[dict[str, Any]],
    box: TimeBox,
) -> float | None:
    """The last step's seconds of :data:`STEPS` steps of ``mode`` at ``seq`` under
    ``cap``, or None where one ran out of memory."""
    if box.over():
        raise TimeUp
    bench.empty_cache()
    before = bench.allocated()
    bench.cap(cap)
    model = bench.model(checkpointing=mode == "checkpoint")
    seconds: float | None = None
    ids = bench.ids(seq)
    try:
        make = context(mode, model, bench, limit=cap)
        for _ in range(STEPS):
            seconds = bench.step(model, ids, make).seconds
    except torch.OutOfMemoryError:
        seconds = None  # (cleaned up below, once the error and its frames are gone)
    bench.drop(model)
    del model, ids
    left = bench.after_oom(before)
    bench.cap(None)
    tries.append({"seq": seq, "trained": seconds is not None, "step_s": seconds, **left})
    return seconds


def _bisect(ok: Callable[[int], float | None], high: int) -> int:
    """The largest ``k`` in ``[1, high]`` for which ``ok(k)`` is not None (0 if none):
    ``ok`` holds for every ``k`` under one it holds for, so the first ``k`` it fails for
    is found by bisection, each ``ok`` called once as the search reaches it."""
    return bisect.bisect_left(range(1, high + 1), True, key=lambda k: ok(k) is None)
