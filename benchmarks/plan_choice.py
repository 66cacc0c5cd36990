"""How long a goal's plan takes to choose, against how many storages a forward saves.

A forward of a large model saves thousands of storages; a goal's plan is made after its
measured step and again whenever the lengths grow, so choosing must cost little beside a
step. This times ``Planner.adopt`` (the choice, and the schedule, window and head start
of the plan chosen) for ``max_overhead=0.05`` and ``device_limit`` on forwards of 145
(the H100 Llama's), 500, 2000 and 5000 storages of a transformer's mix of sizes, saved
evenly over 25 ms, on an H100's link; median and range of 7 runs each. The goal: at most
50 ms at 2,000 storages. Pure Python, no device.

    python benchmarks/plan_choice.py [--json PATH]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Spread, print_table, write_json

from leakfree.offload.options import Options
from leakfree.offload.plan import Measurement, Planner

MiB = 1 << 20
COUNTS = (145, 500, 2000, 5000)
RUNS = 7


def measurement(n: int, seed: int = 0) -> Measurement:
    """``n`` storages of a transformer's mix of sizes, saved evenly over a 25 ms forward
    (backward twice as long), on a 55 / 54 GB/s link, peaking with all of them and a
    third more."""
    rng = random.Random(seed)
    sizes = tuple(rng.choice((64, 32, 85, 2, 1)) * MiB // 4 for _ in range(n))
    made = tuple(0.025 * k / n for k in range(n))
    total = sum(sizes)
    return Measurement(
        sizes, made, 0.025, 0.05, 55e9, 54e9, int(1.3 * total), total // 7, 0, 1 << 26
    )


def time_adopt(m: Measurement, options: Options) -> list[float]:
    """Milliseconds of each of :data:`RUNS` plans made from ``m``."""
    out = []
    for _ in range(RUNS):
        planner = Planner(options)
        start = time.perf_counter()
        planner.adopt(m, 0, checkable=False)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="benchmarks/plan_choice.py", description=__doc__)
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args(argv)
    rows, results = [], []
    for n in COUNTS:
        m = measurement(n)
        goals = {
            "max_overhead=0.05": Options(max_overhead=0.05),
            "device_limit": Options(device_limit=sum(m.sizes)),
        }
        for goal, options in goals.items():
            spread = Spread.of(time_adopt(m, options))
            rows.append([n, goal, f"{spread.median:.1f}", f"{spread.low:.1f}-{spread.high:.1f}"])
            results.append({"storages": n, "goal": goal, "ms": spread.as_dict()})
    print_table(
        f"Choosing a goal's plan (Planner.adopt), median of {RUNS} runs; goal: 50 ms at 2,000",
        ["storages", "goal", "ms", "range"],
        rows,
    )
    payload = {"runs": RUNS, "results": results}
    write_json("plan_choice", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
