"""Run every benchmark, then write one JSON and a markdown summary (README's performance table).

    python benchmarks/run_all.py [--quick] [--out DIR]

Each benchmark runs in its own process (so none inherits another's allocations or
threads) and writes its JSON into DIR (default benchmarks/results); this script reads
them back into DIR/all.json and DIR/summary.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BENCHMARKS = ["function_overhead", "losslog", "offload", "pipeline", "tracker", "tracker_hf"]


def summary(results: dict[str, Any]) -> str:
    rows = [("benchmark", "measure", "leakfree", "baseline", "ratio / goal")]
    f = {r["op"]: r for r in results["function_overhead"]["results"]}
    for op in ("1-element mul", "1024x1024 matmul"):
        r = f[op]
        rows.append(
            (
                "Function",
                f"fwd+bwd, {op}",
                f"{r['leakfree_us']:.1f} us",
                f"{r['plain_us']:.1f} us",
                f"{r['ratio']:.2f}x" + (" (goal 1.10x)" if op.startswith("1-") else ""),
            )
        )
    ll = results["losslog"]
    rows.append(
        (
            "LossLog",
            f"bytes retained, {ll['microbatches']} mb x {ll['keys']} keys",
            f"{ll['retained_bytes']['LossLog']} B",
            f"{ll['retained_bytes']['plain dict']} B",
            "goal 0",
        )
    )
    rows.append(
        (
            "LossLog",
            "device-to-host syncs per step",
            str(ll["host_syncs"]["LossLog.reduce"]),
            str(ll["host_syncs"]["per-item .item()"]),
            "goal 1",
        )
    )
    a = ll["append_us"]
    rows.append(
        (
            "LossLog",
            "append",
            f"{a['LossLog list']:.2f} us",
            f"{a['plain list']:.2f} us",
            f"{a['LossLog list'] / a['plain list']:.2f}x (goal 1.3x)",
        )
    )
    for r in results["offload"]["cpu_hook_cost"]:
        if r["mode"].startswith("leakfree"):
            rows.append(
                (
                    "OffloadActivations",
                    f"CPU step, width {r['width']}, {r['mode']} (real host copy)",
                    f"{r['us_per_step']:.1f} us",
                    "save_on_cpu",
                    f"{r['ratio_vs_save_on_cpu']} (goal 1.1x)",
                )
            )
    live = results["offload"]["cpu_live_bytes"]["leakfree"]
    rows.append(
        (
            "OffloadActivations",
            f"bytes alive after each of {len(live)} steps",
            f"max {max(live)} B",
            "",
            "",
        )
    )
    for r in results["offload"].get("accelerator", []):
        if r["peak_mib"] is not None:
            rows.append(
                (
                    "OffloadActivations",
                    f"GPU peak / step, {r['mode']}",
                    f"{r['peak_mib']:.0f} MiB",
                    f"{r['step_ms']:.1f} ms",
                    "",
                )
            )
    p = results["pipeline"]
    rows.append(
        (
            "pipeline",
            "as_nonleaf extra per microbatch",
            f"{p['extra_us']['as_nonleaf']:.1f} us",
            "leaf receive",
            "goal <= 10 us",
        )
    )
    lb = p["live_bytes"]
    rows.append(
        (
            "pipeline",
            f"bytes held after {len(lb['RecvBufferPool'])} microbatches",
            f"{lb['RecvBufferPool'][-1]} B",
            f"{lb['leaf receive'][-1]} B",
            "",
        )
    )
    for r in results["tracker"]["results"]:
        rows.append(
            (
                "MemoryTracker",
                f"CPU tracker, {r['case']}",
                f"{r['on_ms']:.1f} ms",
                f"{r['off_ms']:.1f} ms",
                f"{r['ratio']:.2f}x (goal 1.5x)",
            )
        )
    for r in results["tracker_hf"]["results"]:
        q = r["ratio"]
        rows.append(
            (
                "MemoryTracker",
                f"causal LM, {r['case']}, tracked every {r['sample_every']} step(s)",
                f"{r['on_ms_per_step']:.1f} ms",
                f"{r['off_ms_per_step']:.1f} ms",
                f"{q['median']:.2f}x, IQR {q['q1']:.2f}-{q['q3']:.2f} (goal 1.5x)",
            )
        )
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (smoke run)")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for name in BENCHMARKS:
        t0 = time.perf_counter()
        cmd = [sys.executable, str(HERE / f"{name}.py"), "--json", str(out / f"{name}.json")]
        if args.quick:
            cmd.append("--quick")
        subprocess.run(cmd, check=True)
        results[name] = json.loads((out / f"{name}.json").read_text())
        print(f"[{name}: {time.perf_counter() - t0:.0f} s]", file=sys.stderr)
    (out / "all.json").write_text(json.dumps(results, indent=2) + "\n")
    table = summary(results)
    (out / "summary.md").write_text(table)
    print("\n" + table)
    print(f"wrote {out / 'all.json'} and {out / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
