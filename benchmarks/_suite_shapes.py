"""The GPU suite's shapes part: sequence lengths that change every step.

Lengths cycling 4096 / 3584 / 3072 (three times), for the default, ``max_overhead=0.05``
and ``device_limit`` (none's held peak at the longest less 1 GiB), each on a fresh model
with the cache emptied once before its first step, as in training. Each step's time is
divided by no offloading's at its length (measured first, the second of two steps at each
length on a model of its own), and what it allocated and held beyond what was allocated
before it is kept, with the absolute held peak that ``device_limit`` bounds.
"""

from __future__ import annotations

import contextlib
from typing import Any

from _suite_device import LEAKFREE_GOALS, Bench, context, under
from _suite_report import TimeBox

LENGTHS = (4096, 3584, 3072)
CYCLES = 3


def shapes(bench: Bench, box: TimeBox, *, cycles: int = CYCLES) -> dict[str, Any]:
    """Each of :data:`LEAKFREE_GOALS` over the cycling lengths (see the module doc), in
    ``box``."""
    lengths = [n for _ in range(cycles) for n in LENGTHS]
    out: dict[str, Any] = {"lengths": lengths, "modes": {}}
    none: dict[int, Any] = {}
    model = bench.model()
    bench.empty_cache()
    for seq in LENGTHS:
        ids = bench.ids(seq)
        bench.step(model, ids, contextlib.nullcontext)
        none[seq] = bench.step(model, ids, contextlib.nullcontext)
    bench.drop(model)
    out["none"] = {str(s): {"step_s": n.seconds, "held_bytes": n.held} for s, n in none.items()}
    ceiling = none[LENGTHS[0]].held - under(none[LENGTHS[0]].held)
    for mode in LEAKFREE_GOALS:
        if box.over():
            out["timed_out"] = f"stopped before {mode}"
            break
        out["modes"][mode] = _mode(bench, mode, lengths, none, ceiling, box)
        box.keep(out)
    return out


def _mode(
    bench: Bench,
    mode: str,
    lengths: list[int],
    none: dict[int, Any],
    ceiling: int,
    box: TimeBox,
) -> dict[str, Any]:
    model = bench.model()
    bench.empty_cache()
    limit = bench.allocated() + ceiling
    steps: list[dict[str, Any]] = []
    out: dict[str, Any] = {"device_limit": limit if mode == "device_limit" else None}
    try:
        make = context(mode, model, bench, limit=limit)
        for seq in lengths:
            if box.over():
                out["timed_out"] = f"stopped after {len(steps)} of {len(lengths)} steps"
                break
            step = bench.step(model, bench.ids(seq), make)
            steps.append(
                {
                    "seq": seq,
                    "ratio_vs_none": step.seconds / none[seq].seconds,
                    "allocated_bytes": step.allocated,
                    "held_bytes": step.held,
                    "held_total_bytes": step.held_total,
                    "to_host_bytes": step.to_host,
                }
            )
        plan = getattr(make(), "plan", None)
        out["replans"] = getattr(plan, "replans", None)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        bench.drop(model)
    out["steps"] = steps
    later = steps[len(LENGTHS) :]  # after the first cycle: every length planned once
    if later:
        out["mean_ratio_after_first_cycle"] = sum(s["ratio_vs_none"] for s in later) / len(later)
    if steps:
        out["held_most_bytes"] = max(s["held_bytes"] for s in steps)
    if mode == "device_limit":
        out["under_limit_every_step"] = bool(steps) and all(
            s["held_total_bytes"] <= limit for s in steps
        )
    return out
