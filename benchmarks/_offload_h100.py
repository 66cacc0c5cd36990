"""The H100 tables of the H100 run, predicted, for offload.py.

``tests/simdev/predict.py`` runs the H100 run's Llama (542M parameters, bf16, batch
2 x 4096) dry on the simulated device, timed by ``tests/simdev/timing.py``'s H100 model.
Two tables:

* the model against the measurement: every row of the H100 run's tables, each with its
  own model config, run with the schedule that was measured (e7732f1), predicted beside
  measured, the rows the model was fitted on apart from those held out
  (``tests/simdev/calibration.py``);
* today's code on the same model: the default, the goals (``max_overhead``,
  ``device_limit``), the budgets, ``save_on_cpu`` and TRL's manager, with the bytes each
  way and the time both copy engines were busy at once.

Every number here is predicted (no GPU ran it); the H100 run has the measured ones.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

from _common import print_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.simdev import calibration as fit
from tests.simdev import predict as h100

GiB = 1 << 30

#: the targets on this model, on what the device holds (reserved), at batch 2 x 4096
TARGETS = (
    "default: held peak at least 40% below none's, at most 2.6x",
    "max_overhead=0.05: at most 1.07x, held peak at least 15% below none's",
    "device_limit = none's held peak - 1 GiB: held under it every step, at most 1.15x",
    "lengths cycling 4096/3584/3072 and a packing trace: each mode within 10% of its fixed "
    "ratio, max_overhead moving at least 80% of its bytes, device_limit under its ceiling",
)

#: steps per mode at the fixed length (the goals measure, check and correct first)
FIXED_STEPS = 8
#: lengths cycling, and a packing trace (each step's tokens drawn from 1024-4096)
CYCLING = [4096, 3584, 3072] * 4
PACKED = [4096, 1536, 3072, 2560, 4096, 1024, 3584, 2048, 4096, 3072, 1536, 4096]


def section() -> dict[str, Any] | str:
    """The tables, printed and returned (or why they were not run)."""
    if not h100._device.supported():
        return "not run: the simulated device does not support this torch"
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "not run: transformers is not installed"
    with h100.dry_device() as sim, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibration = fit.calibration(sim, trl=_has_trl())
        runs, limit = held_runs(sim)
    return {
        "device": "H100 model (tests/simdev/timing.py), predicted",
        "calibration": _calibration_table(calibration),
        "frontier": _frontier_table(runs),
        "lengths": _lengths_table(runs, limit),
        "targets": _targets(runs, limit),
    }


def held_runs(sim: Any) -> tuple[dict[str, list[h100.Step]], int]:
    """Every mode's steps at the fixed length, and the goals' and the default's over the
    two traces; the limit (none's held peak less 1 GiB, absolute)."""
    none: dict[int, float] = {}
    runs = {"none": h100.steps(sim, "none", [4096] * 2, none=none)}
    sim.module.empty_cache()
    model = h100.llama(sim.device)
    params = sim.allocated()
    model.to_empty(device="meta")
    sim.module.empty_cache()
    limit = params + runs["none"][-1].held_peak - GiB
    modes = ["default", "max_overhead=0.05", f"device_limit={limit}", "use_streams=False"]
    modes += ["save_on_cpu"] + (["trl"] if _has_trl() else [])
    for mode in modes:
        runs[_name(mode)] = h100.steps(sim, mode, [4096] * FIXED_STEPS, none=none)
    for trace, lengths in (("cycling", CYCLING), ("packed", PACKED)):
        runs[f"none {trace}"] = h100.steps(sim, "none", lengths, none=none)
        for mode in modes[:3]:
            runs[f"{_name(mode)} {trace}"] = h100.steps(sim, mode, lengths, none=none)
    return runs, limit


def _name(mode: str) -> str:
    return "device_limit" if mode.startswith("device_limit=") else mode


def _has_trl() -> bool:
    try:
        import trl.models.activation_offloading  # noqa: F401
    except Exception:
        return False
    return True


def _calibration_table(
    predicted: dict[tuple[str, str], h100.Prediction],
) -> dict[str, Any]:
    found = fit.errors(predicted)
    print_table(
        "H100 model against the H100 run (H100 measured; the schedule measured then, "
        "e7732f1): the FLOP rate fitted on the 'fitted' rows, the others held out",
        list(fit.HEADERS),
        fit.rows(found),
    )
    summary = fit.summary(found)
    for what, error in summary.items():
        print(f"  {what}: {error:.1%}")
    return {
        "rows": [
            {
                "table": e.table,
                "mode": e.mode,
                "fitted": e.fitted,
                "measured_ratio": e.measured.ratio,
                "predicted_ratio": round(e.ratio, 3),
                "ratio_error": _round(e.ratio_error),
                "measured_step_ms": e.measured.step_ms,
                "predicted_step_ms": round(e.step_ms, 1),
                "measured_activation_gib": e.measured.activation_gib,
                "predicted_activation_gib": round(e.activation_gib, 2),
                "activation_error": _round(e.activation_error),
                "measured_to_host_gib": e.measured.to_host_gib,
                "predicted_to_host_gib": round(e.to_host_gib, 2),
                "to_host_error": _round(e.to_host_error),
            }
            for e in found
        ],
        "errors": {k: round(v, 3) for k, v in summary.items()},
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _frontier_table(runs: dict[str, list[h100.Step]]) -> list[dict[str, Any]]:
    none = runs["none"][-1]
    rows = []
    for mode, steps in runs.items():
        if " " in mode:  # the traces: their own table
            continue
        last = steps[-1]
        rows.append(
            {
                "mode": mode,
                "ratio": round(last.ratio, 3),
                "activation_gib": round(last.activation_peak / GiB, 2),
                "held_gib": round(last.held_peak / GiB, 2),
                "held_most_gib": round(max(s.held_peak for s in steps) / GiB, 2),
                "held_lower_than_none": round(1 - last.held_peak / none.held_peak, 3),
                "gib_to_host": round(last.to_host / GiB, 2),
                "first_steps": [round(s.ratio, 2) for s in steps[:-1]],
                "plan": str(last.plan) if last.plan is not None else None,
            }
        )
    print_table(
        "Predicted on the H100 model, today's code, batch 2 x 4096, the last of "
        f"{FIXED_STEPS} steps (no GPU ran these): allocated is the caching allocator's "
        "count, held what it reserves (what decides an out-of-memory error)",
        [
            "mode",
            "vs none",
            "alloc. GiB",
            "held GiB",
            "held, most GiB",
            "held lower",
            "GiB to host",
            "first steps",
        ],
        [
            (
                r["mode"],
                f"{r['ratio']:.2f}x",
                r["activation_gib"],
                r["held_gib"],
                r["held_most_gib"],
                f"{r['held_lower_than_none']:.0%}",
                r["gib_to_host"],
                " ".join(f"{x:.2f}" for x in r["first_steps"]),
            )
            for r in rows
        ],
    )
    return rows


def _steady(steps: list[h100.Step]) -> list[h100.Step]:
    """The steps after the first three (a goal's measured step, its check, a correction)."""
    return steps[3:]


def _lengths_table(runs: dict[str, list[h100.Step]], limit: int) -> list[dict[str, Any]]:
    rows = []
    for name, steps in runs.items():
        if " " not in name:
            continue
        mode, trace = name.rsplit(" ", 1)
        steady = _steady(steps)
        fixed = runs[mode][-1]
        moved = [s.to_host * 4096 / s.seq for s in steady]  # at 4096 tokens' worth
        rows.append(
            {
                "mode": mode,
                "trace": trace,
                "ratio": round(sum(s.ratio for s in steady) / len(steady), 3),
                "fixed_ratio": round(fixed.ratio, 3),
                "held_most_gib": round(max(s.held_peak for s in steps) / GiB, 2),
                "moved_vs_fixed": round(sum(moved) / len(moved) / fixed.to_host, 3)
                if fixed.to_host
                else None,
            }
        )
    print_table(
        "Lengths that change every step (cycling 4096/3584/3072, and a packing trace): the "
        "mean ratio after three steps against the fixed length's, the most held, and the "
        "bytes moved per 4096 tokens against the fixed length's",
        ["mode", "trace", "vs none", "fixed", "held, most GiB", "moved vs fixed"],
        [
            (
                r["mode"],
                r["trace"],
                f"{r['ratio']:.2f}x",
                f"{r['fixed_ratio']:.2f}x",
                r["held_most_gib"],
                "-" if r["moved_vs_fixed"] is None else f"{r['moved_vs_fixed']:.0%}",
            )
            for r in rows
        ],
    )
    return rows


def _targets(runs: dict[str, list[h100.Step]], limit: int) -> dict[str, str]:
    none = runs["none"][-1]

    def last(mode: str) -> h100.Step:
        return runs[mode][-1]

    def lower(mode: str) -> float:
        return 1 - last(mode).held_peak / none.held_peak

    ceiling = none.held_peak - GiB  # the limit, beyond what the device held before a step
    within = all(s.held_peak <= ceiling for s in runs["device_limit"])
    traces = []
    for trace in ("cycling", "packed"):
        for mode in ("default", "max_overhead=0.05", "device_limit"):
            steady = _steady(runs[f"{mode} {trace}"])
            mean = sum(s.ratio for s in steady) / len(steady)
            traces.append((trace, mode, mean / last(mode).ratio))
    packed_limit = all(
        s.held_peak <= ceiling for t in ("cycling", "packed") for s in runs[f"device_limit {t}"]
    )
    verdicts = {
        TARGETS[0]: _verdict(
            lower("default") >= 0.40 and last("default").ratio <= 2.6,
            f"{last('default').ratio:.2f}x, held {lower('default'):.0%} lower",
        ),
        TARGETS[1]: _verdict(
            last("max_overhead=0.05").ratio <= 1.07 and lower("max_overhead=0.05") >= 0.15,
            f"{last('max_overhead=0.05').ratio:.2f}x, held {lower('max_overhead=0.05'):.0%} lower",
        ),
        TARGETS[2]: _verdict(
            within and last("device_limit").ratio <= 1.15,
            f"{last('device_limit').ratio:.2f}x, held under the limit every step: {within}",
        ),
        TARGETS[3]: _verdict(
            all(0.9 <= r <= 1.1 for _, _, r in traces) and packed_limit,
            "; ".join(f"{m} {t} {r:.2f} of fixed" for t, m, r in traces)
            + f"; device_limit under its ceiling every step: {packed_limit}",
        ),
    }
    print("\nTargets (predicted):")
    for what, verdict in verdicts.items():
        print(f"  {what}: {verdict}")
    return verdicts


def _verdict(ok: bool, detail: str) -> str:
    return f"{'met' if ok else 'NOT met'}: {detail}"
