"""Measure ``python -m leakfree run --fail --json`` on every corpus script, against the same
script plain, and write the table (BEFORE.md / AFTER.md) and its JSON.

    python tests/integration/corpus/measure.py [--rounds 3] [--out BEFORE] [NAME ...]
    python tests/integration/corpus/measure.py --render BEFORE   # the table, from the JSON

Each script runs at each of its step counts, plain and under ``leakfree run`` at its
defaults, in a new interpreter each time (one intra-op thread), alternating which goes first
round by round; the whole process's wall time is compared round by round (imports and every
one-off cost of the watch included), as ``benchmarks/run_overhead.py`` does. The verdict,
the holder and the creating line are read from the first round's JSON report, and every
round's exit status is kept, so a verdict that changes between rounds shows.

What is read from a report (reading.py, as the tests read it): ``holder named`` is whether a
holder the report names matches the case's (manifest.py); ``named as`` is what leakfree named
(the holders' paths, a cycle, or "no holder found"); ``line cited`` is whether the creation
site of the ``# MADE`` line (file, line, function) is in a finding; ``grew-then-flat`` is
whether a plateau control's report says ``grew by ... then flat for N steps``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from tests.integration.corpus import reading  # noqa: E402
from tests.integration.corpus.manifest import BY_NAME, CASES, Case  # noqa: E402


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def once(case: Case, steps: int, watched: bool, cwd: str) -> dict[str, Any]:
    """One process: its exit status, wall time, and (watched) the JSON report and stderr."""
    out = Path(cwd, f"{case.name}-{steps}.json")
    out.unlink(missing_ok=True)
    command = [sys.executable, str(case.path), str(steps)]
    if watched:
        command[1:1] = ["-m", "leakfree", "run", "--fail", "--json", str(out)]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=900, env=_env())
    wall = time.perf_counter() - start
    result: dict[str, Any] = {"status": done.returncode, "wall_s": wall}
    if watched:
        result["report"] = json.loads(out.read_text()) if out.exists() else {}
        result["stderr_tail"] = done.stderr[-4000:]
    elif done.returncode != 0:
        result["stderr_tail"] = done.stderr[-2000:]
    return result


def judge(case: Case, steps: int, report: dict[str, Any], stderr: str) -> dict[str, Any]:
    """What a report says about one run, as the table reports it."""
    findings = reading.findings(report)
    holders = [str(h["where"]) for f in findings for h in f.get("holders", [])]
    holders += [f"cycle: {f['cycle']}" for f in findings if f.get("cycle")]
    first = findings[0] if findings else {}
    row: dict[str, Any] = {
        "verdict": report.get("verdict"),
        "judged_steps": report.get("judged_steps"),
        "needed_steps": report.get("needed_steps"),
        "findings": len(findings),
        "kind": first.get("kind"),
        "bytes_per": first.get("bytes_per"),
        "found_at_step": first.get("step"),
        "named_as": holders[:4] or (["no holder found"] if findings else []),
    }
    if case.role == "leak":
        row["holder_named"] = reading.holder_named(case, report)
        row["line_cited"] = reading.line_cited(case, report)
    if case.flat_after is not None:
        row["grew_then_flat"] = reading.grew_then_flat(stderr) is not None
    return row


def measure(case: Case, steps: int, rounds: int) -> dict[str, Any]:
    plain: list[dict[str, Any]] = []
    watched: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="corpus-measure-") as cwd:
        for r in range(rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for w in order:
                (watched if w else plain).append(once(case, steps, w, cwd))
    ratios = [w["wall_s"] / p["wall_s"] for w, p in zip(watched, plain)]
    first = watched[0]
    row = {
        "name": case.name,
        "role": case.role,
        "shape": case.shape,
        "steps": steps,
        "exit": first["status"],
        "exits": [w["status"] for w in watched],
        "plain_exits": [p["status"] for p in plain],
        **judge(case, steps, first["report"], first["stderr_tail"]),
        "plain_s": statistics.median(p["wall_s"] for p in plain),
        "run_s": statistics.median(w["wall_s"] for w in watched),
        "overhead_median": statistics.median(ratios),
        "overhead_min": min(ratios),
        "overhead_max": max(ratios),
        "report": first["report"],
    }
    return row


def _mark(value: Any) -> str:
    return {True: "yes", False: "**no**", None: ""}.get(value, str(value))


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| script | role | steps | exit (rounds) | verdict | holder named? | named as | "
        "line cited? | B/step (kind, at step) | grew-then-flat? | plain s | run s | "
        "overhead median (min-max) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        per = ""
        if r["bytes_per"] is not None:
            per = f"{r['bytes_per']:.0f} ({r['kind']}, {r['found_at_step']})"
        named = "; ".join(f"`{n}`" for n in r["named_as"]) if r["named_as"] else ""
        verdict = r["verdict"]
        if verdict == "not judged":
            verdict = f"not judged ({r['judged_steps']}/{r['needed_steps']})"
        lines.append(
            f"| {r['name']} | {r['role']} | {r['steps']} | {r['exit']} "
            f"({','.join(map(str, r['exits']))}) | {verdict} | {_mark(r.get('holder_named'))} | "
            f"{named} | {_mark(r.get('line_cited'))} | {per} | "
            f"{_mark(r.get('grew_then_flat'))} | {r['plain_s']:.2f} | {r['run_s']:.2f} | "
            f"{r['overhead_median']:.2f}x ({r['overhead_min']:.2f}-{r['overhead_max']:.2f}) |"
        )
    return head + "\n".join(lines) + "\n"


def _commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "leakfree"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() + (" (leakfree/ modified)" if dirty.stdout.strip() else "")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="BEFORE", help="BEFORE or AFTER: the files written")
    p.add_argument("--steps", help="only these step counts (comma-separated)")
    p.add_argument("--render", metavar="NAME", help="print NAME.json's table and exit")
    args = p.parse_args(argv)
    if args.render:
        data = json.loads((HERE / f"{args.render}.json").read_text())
        print(table(data["rows"]), end="")
        return 0
    names = args.names or [c.name for c in CASES]
    only = {int(s) for s in args.steps.split(",")} if args.steps else None
    rows = []
    started = datetime.datetime.now(datetime.timezone.utc)
    for name in names:
        case = BY_NAME[name]
        for steps in case.steps:
            if only is not None and steps not in only:
                continue
            row = measure(case, steps, args.rounds)
            rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
    meta = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(),
        "python": platform.python_version(),
        "torch": __import__("torch").__version__,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
    }
    (HERE / f"{args.out}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
