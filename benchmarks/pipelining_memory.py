"""torch.distributed.pipelining, unpatched vs repaired by ``leakfree.patch_all()``: per rank,
peak bytes within a step, bytes held between steps, and step time, for every schedule torch
ships, on 2 and 4 gloo ranks (127.0.0.1).

The model is the one the repair was found on: 8 blocks of Linear(256) + GELU split evenly
over the stages, batch 32, 8 microbatches, SGD. The runs are tests/_pipelining.py's (the
integration tests use the same ones, smaller):

* **bytes**: an independent ``TorchDispatchMode`` counts every storage the ranks' ops make,
  by weak reference; the peak is sampled at the start and end of every forward and backward,
  "between" is after the optimizer step. Beside each, the *floor*: a lower bound from
  autograd's own needs (saved tensors of the microbatches in flight, the gradients, the
  step's batch: ``tests/_pipelining.py:_floor``); between steps the floor is what the caller
  keeps (the losses, on the last stage);
* **step time**: separate runs without the counting mode, unpatched and patched
  interleaved (the order alternating, so neither always runs first), ``--repeat`` times;
  each run's step time is the median of its steps after the first (the first also infers
  shapes); the ratio patched / unpatched is taken per repetition, and its median and range
  are reported. Each rank gets its share of the cores as intra-op threads
  (``cpu_count // ranks``, tests/_dist.py): more only spin against each other.

    python benchmarks/pipelining_memory.py [--quick] [--ranks 2,4] [--schedules A,B]
        [--repeat N] [--steps N] [--dim 256] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from _common import Spread, print_table, write_json

from leakfree._text import format_table
from tests import _pipelining as P
from tests._dist import run_workers

MODES = {"unpatched": None, "patched": {}}


def _worker(rank: int, world: int, plan: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}  # tests/_dist.py gives each rank its share of the cores
    for schedule in plan["schedules"]:
        entry: dict[str, Any] = {"memory": {}, "seconds": {m: [] for m in MODES}}
        for mode, patch in MODES.items():
            r = P.run(
                P.Config(schedule, patch=patch, steps=3, dim=plan["dim"], sink="PipelineLosses"),
                rank,
                world,
            )
            entry["memory"][mode] = {
                "peak": max(r.peak_bytes[1:]),
                "between": r.live_bytes[-1],
                "floor_peak": max(r.peak_floor[1:]),
                "floor_between": r.caller_bytes[-1],
                "sent_alive_peak": max(r.sent_alive_peak[1:]),
                "hook_fires": r.hook_fires,
                "grads": r.grads,
            }
        for i in range(plan["repeat"]):  # interleaved, the order alternating (ABBA...)
            order = list(MODES.items())
            for mode, patch in order if i % 2 == 0 else order[::-1]:
                config = P.Config(
                    schedule, patch=patch, steps=plan["steps"], dim=plan["dim"], observe=False
                )
                r = P.run(config, rank, world)
                entry["seconds"][mode].append(statistics.median(r.step_seconds[1:]))
        out[schedule] = entry
    return out


def measure(world: int, plan: dict[str, Any]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        return run_workers(_worker, world, Path(tmp), plan, timeout=3000)  # type: ignore[no-any-return]


def _kib(n: int) -> str:
    return f"{n / 1024:.0f}"


SUMMARY_HEADER = [
    "schedule",
    "ranks",
    "peak KiB, worst rank: unpatched / patched (floor)",
    "KiB held between steps, all ranks: unpatched / patched",
    "rank 0 sent outputs alive: unpatched / patched",
    "hook fires per step, last rank, steps 2-3: unpatched / patched",
    "step time patched / unpatched: median of ranks [range]",
]


def summary_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    """One row per (schedule, ranks): the README's table."""
    rows = []
    keys = dict.fromkeys((r["schedule"], r["ranks"]) for r in results)
    for schedule, ranks in keys:
        mine = [r for r in results if r["schedule"] == schedule and r["ranks"] == ranks]
        worst = max(mine, key=lambda r: r["peak_bytes"]["unpatched"])
        first, last = mine[0], mine[-1]
        plain_hooks = last["hook_fires_per_step"]["unpatched"][1:]
        fixed_hooks = last["hook_fires_per_step"]["patched"][1:]
        ratios = [r["step_time_ratio"] for r in mine]
        rows.append(
            [
                schedule.removeprefix("Schedule"),
                str(ranks),
                f"{_kib(worst['peak_bytes']['unpatched'])} / {_kib(worst['peak_bytes']['patched'])}"
                f" ({_kib(worst['peak_floor_bytes'])})",
                f"{_kib(sum(r['between_bytes']['unpatched'] for r in mine))} / "
                f"{_kib(sum(r['between_bytes']['patched'] for r in mine))}",
                f"{first['sent_outputs_alive_peak']['unpatched']} / "
                f"{first['sent_outputs_alive_peak']['patched']}",
                f"{plain_hooks} / {fixed_hooks}",
                f"{statistics.median(x['median'] for x in ratios):.2f} "
                f"[{min(x['min'] for x in ratios):.2f}-{max(x['max'] for x in ratios):.2f}]",
            ]
        )
    return rows


def markdown(header: list[str], rows: list[list[Any]]) -> str:
    return format_table(header, [[str(c) for c in r] for r in rows], markdown=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="two schedules, 2 ranks, 2 repeats")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--schedules", default=",".join(P.ALL))
    ap.add_argument("--repeat", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--json", default=None)
    ap.add_argument("--from-json", default=None, help="print the tables of an earlier run")
    args = ap.parse_args()
    if args.from_json:
        earlier = json.loads(Path(args.from_json).read_text())
        print(markdown(earlier["header"], earlier["rows"]))
        print()
        print(markdown(SUMMARY_HEADER, summary_rows(earlier["results"])))
        return
    if args.quick:
        args.ranks, args.schedules, args.repeat, args.steps = (
            "2",
            "ScheduleGPipe,Schedule1F1B",
            2,
            4,
        )
    plan = {
        "schedules": args.schedules.split(","),
        "repeat": args.repeat,
        "steps": args.steps,
        "dim": args.dim,
    }
    rows: list[list[Any]] = []
    results: list[dict[str, Any]] = []
    started = time.monotonic()
    for world in [int(w) for w in args.ranks.split(",")]:
        per_rank = measure(world, plan)
        for schedule in plan["schedules"]:
            for rank, by_schedule in enumerate(per_rank):
                e = by_schedule[schedule]
                plain, fixed = e["memory"]["unpatched"], e["memory"]["patched"]
                ratio = Spread.of(
                    [b / a for a, b in zip(e["seconds"]["unpatched"], e["seconds"]["patched"])]
                )
                result = {
                    "ranks": world,
                    "schedule": schedule,
                    "rank": rank,
                    "peak_bytes": {"unpatched": plain["peak"], "patched": fixed["peak"]},
                    "peak_floor_bytes": fixed["floor_peak"],
                    "between_bytes": {"unpatched": plain["between"], "patched": fixed["between"]},
                    "between_floor_bytes": fixed["floor_between"],
                    "sent_outputs_alive_peak": {
                        "unpatched": plain["sent_alive_peak"],
                        "patched": fixed["sent_alive_peak"],
                    },
                    "hook_fires_per_step": {
                        "unpatched": plain["hook_fires"],
                        "patched": fixed["hook_fires"],
                    },
                    "gradients_bit_identical": plain["grads"] == fixed["grads"],
                    "step_seconds": {m: Spread.of(v).as_dict() for m, v in e["seconds"].items()},
                    "step_time_ratio": ratio.as_dict(),
                }
                results.append(result)
                rows.append(
                    [
                        world,
                        schedule.removeprefix("Schedule"),
                        rank,
                        f"{_kib(plain['peak'])} / {_kib(fixed['peak'])}",
                        _kib(fixed["floor_peak"]),
                        f"{_kib(plain['between'])} / {_kib(fixed['between'])}",
                        _kib(fixed["floor_between"]),
                        f"{plain['sent_alive_peak']} / {fixed['sent_alive_peak']}",
                        f"{statistics.median(e['seconds']['unpatched']) * 1e3:.1f}",
                        f"{ratio.median:.3f} [{ratio.low:.3f}-{ratio.high:.3f}]",
                        "yes" if result["gradients_bit_identical"] else "NO",
                    ]
                )
    header = [
        "ranks",
        "schedule",
        "rank",
        "peak KiB unpatched / patched",
        "peak floor",
        "between KiB unpatched / patched",
        "between floor",
        "sent outputs alive",
        "step ms unpatched",
        "step time patched / unpatched, median [range]",
        "same bits",
    ]
    print_table(
        f"torch.distributed.pipelining, 8 x Linear({args.dim})+GELU, batch {P.BATCH}, "
        f"{P.N_MB} microbatches, gloo on CPU ({args.repeat} interleaved repeats)",
        header,
        rows,
    )
    summary = summary_rows(results)
    print_table("per schedule (the README's table)", SUMMARY_HEADER, summary)
    ratios = [r["step_time_ratio"]["median"] for r in results]
    print(
        f"\nstep time patched / unpatched over all rows: median {statistics.median(ratios):.3f}, "
        f"range {min(ratios):.3f}-{max(ratios):.3f}; {time.monotonic() - started:.0f} s"
    )
    write_json(
        "pipelining_memory",
        {
            "command": " ".join(sys.argv),
            "model": f"8 x Linear({args.dim}) + GELU",
            "batch": P.BATCH,
            "microbatches": P.N_MB,
            "repeat": args.repeat,
            "steps": args.steps,
            "results": results,
            "header": header,
            "rows": rows,
            "summary_markdown": markdown(SUMMARY_HEADER, summary),
        },
        args.json,
    )


if __name__ == "__main__":
    main()
