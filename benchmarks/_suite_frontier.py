"""The GPU suite's frontier part: each way of keeping activations against no offloading.

Every mode runs on one model, the same weights (no optimizer step), so the device holds
what a training run of it holds: its parameters, and a step's own memory. leakfree's
managers are told the parameters and register nothing on the model; TRL's manager
registers hooks on its output head, so it gets a model of its own, built for each of its
steps and dropped after. Modes take turns in rounds: each round takes one pair of steps of
every mode, so a noisy machine slows every mode alike. A pair is the cache emptied, one
warm step (it lays out the mode's own cache, as the steps before it would in training)
and one timed step, so what a step *holds* is its own, not the cached blocks of the mode
before it; the ratio to ``none`` is taken round by round. The first rounds are left out
(a goal measures its first step, checks the next and may correct it). Each mode's time,
allocated and held peaks beyond what was allocated before the step, bytes to the host,
memory after every step, and for leakfree's modes every field of the plan, its
predictions beside what was measured.
"""

from __future__ import annotations

import dataclasses
import enum
import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from _common import Spread
from _suite_device import Bench, Step, Unavailable, context, trl_missing, under
from _suite_report import TimeBox

#: the fields of ``ctx.plan`` that hold predictions, read beside their measurement
PLAN_PREDICTIONS = ("overhead", "peak", "held")


#: modes that register hooks on the model they are given: a model of their own, each step
OWN_MODEL = ("trl",)


@dataclass
class Run:
    """One mode."""

    mode: str
    context: Callable[[], Any] | None = None
    timed: dict[int, Step] = field(default_factory=dict)  #: round -> its timed step
    held_totals: list[int] = field(default_factory=list)  #: every step's peak reserved
    error: str | None = None


@dataclass
class Shared:
    """What later modes need from earlier ones: none's held peak (for the limit) and what
    the default moves per step (for the budgets)."""

    none_held: int | None = None
    moved: int | None = None
    limit: int | None = None


def frontier(
    bench: Bench,
    modes: tuple[str, ...],
    *,
    rounds: int,
    warmup: int,
    box: TimeBox,
    profile: Callable[[Any, Run], Any] | None = None,
) -> dict[str, Any]:
    """The frontier (see the module doc), in ``box`` (out of time, it stops after the
    round it is in and says so; what it has is kept after each round);
    ``profile(model, run)``, if given, is called for each leakfree mode after its
    measured steps and its answer kept."""
    ids = bench.ids(bench.size.seq)
    model = bench.model()
    runs = [Run(m, error=_skip(trl_missing() if m.startswith("trl") else None)) for m in modes]
    out: dict[str, Any] = {"rounds_asked": rounds, "warmup_rounds": warmup}
    shared = Shared()
    done = 0
    for index in range(warmup + rounds):
        if box.over():
            out["timed_out"] = f"stopped after {done} of {warmup + rounds} rounds"
            break
        for run in runs:
            if run.error is None:
                _pair(bench, run, model, ids, index, shared)
        done += 1
        gc.collect()
        box.keep({**out, "rounds_done": done, "modes": _results(runs, warmup)})
    modes_out = _results(runs, warmup)
    for run in runs:
        ctx = run.context() if run.error is None and run.context is not None else None
        if profile is not None and hasattr(ctx, "plan") and run.mode not in OWN_MODEL:
            modes_out[run.mode]["profile"] = profile(model, run)  # leakfree's modes
    bench.drop(model)
    out.update(
        rounds_done=done,
        none_held_bytes=shared.none_held,
        default_moved_bytes=shared.moved,
        device_limit=shared.limit,
        modes=modes_out,
    )
    return out


def _skip(missing: str | None) -> str | None:
    return None if missing is None else f"skipped: {missing}"


def _pair(bench: Bench, run: Run, model: Any, ids: Any, index: int, shared: Shared) -> None:
    """The cache emptied, a warm step and a timed one (see the module doc)."""
    own = bench.model() if run.mode in OWN_MODEL else None
    try:
        if run.context is None or own is not None:
            run.context = _make(bench, run, own or model, shared)
        bench.empty_cache()
        warm = bench.step(own or model, ids, run.context)
        timed = bench.step(own or model, ids, run.context)
    except Unavailable as e:
        run.error = f"skipped: {e}"
    except Exception as e:  # kept in the JSON; the other modes go on
        run.error = f"{type(e).__name__}: {e}"[:300]
    else:
        run.timed[index] = timed
        run.held_totals += [warm.held_total, timed.held_total]
        if run.mode == "none" and shared.none_held is None:
            shared.none_held = timed.held
        if run.mode == "default" and timed.to_host:
            shared.moved = timed.to_host
    if own is not None:
        run.context = None
        bench.drop(own)
    if run.error is not None:
        left = bench.after_oom()
        if left["hooks_left_pushed"]:
            run.error += f"; {left['hooks_left_pushed']} saved-tensor hooks were left pushed"


def _make(bench: Bench, run: Run, model: Any, shared: Shared) -> Callable[[], Any]:
    if run.mode == "device_limit" and shared.none_held is not None:
        # none's held peak less 1 GiB, beyond what the device holds before a step (the
        # model): the H100 model's "device_limit = none's held - 1 GiB"
        shared.limit = bench.allocated() + shared.none_held - under(shared.none_held)
    return context(run.mode, model, bench, limit=shared.limit, moved=shared.moved)


def _results(runs: list[Run], warmup: int) -> dict[str, dict[str, Any]]:
    base = next(r for r in runs if r.mode == "none")
    return {r.mode: _result(r, base, warmup) for r in runs}


def _result(run: Run, base: Run, warmup: int) -> dict[str, Any]:
    measured = {i: s for i, s in run.timed.items() if i >= warmup}
    if not measured:
        return {"error": run.error or "no measured step", "plan": _plan(run)}
    steps = list(measured.values())
    ratios = [s.seconds / base.timed[i].seconds for i, s in measured.items() if i in base.timed]
    none_held = max((s.held for i, s in base.timed.items() if i >= warmup), default=0)
    held = max(s.held for s in steps)
    to_host = [s.to_host for s in steps if s.to_host is not None]
    last = steps[-1]
    out: dict[str, Any] = {
        "error": run.error,
        "steps_measured": len(steps),
        "step_s": Spread.of([s.seconds for s in steps]).as_dict(),
        "ratio_vs_none": Spread.of(ratios).as_dict() if ratios else None,
        "allocated_peak_bytes": max(s.allocated for s in steps),
        "held_peak_bytes": held,
        "held_lower_than_none": 1 - held / none_held if none_held else None,
        "to_host_bytes_per_step": sorted(to_host)[len(to_host) // 2] if to_host else None,
        "allocated_after_each_step": [s.after for s in steps],
        "held_total_each_step": run.held_totals,
        "plan": _plan(run),
    }
    plan = out["plan"]
    if plan is not None:
        measured_overhead = out["ratio_vs_none"]["median"] - 1 if ratios else None
        out["plan_vs_measured"] = {
            "overhead": [plan.get("overhead"), measured_overhead],
            "peak": [plan.get("peak"), last.allocated_total],
            "held": [plan.get("held"), last.held_total],
        }
    return out


def _plan(run: Run) -> dict[str, Any] | None:
    """``ctx.plan``, every field of it (whatever this version of leakfree has: measured
    fields beside the predictions, where it keeps them), and its text."""
    if run.context is None or run.mode in OWN_MODEL:
        return None
    plan = getattr(run.context(), "plan", None)
    if plan is None:
        return None
    fields: dict[str, Any] = {"text": str(plan)}
    if dataclasses.is_dataclass(plan):
        for f in dataclasses.fields(plan):
            fields[f.name] = _plain(getattr(plan, f.name))
    for name in PLAN_PREDICTIONS:
        fields.setdefault(name, _plain(getattr(plan, name, None)))
        measured = getattr(plan, f"measured_{name}", None)
        if measured is not None:
            fields[f"measured_{name}"] = _plain(measured)
    return fields


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)
