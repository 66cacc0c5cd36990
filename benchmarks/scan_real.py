"""`leakfree scan` on real installed packages: findings per rule, files, and speed.

The false-positive counts in docs/scan.md come from reading each finding this prints
(`--findings`); this script gives the counts and the speed. Each target is scanned alone
(a fresh Project), 3 times; the speed is the median, with the spread.

    python benchmarks/scan_real.py                # the default targets (installed ones)
    python benchmarks/scan_real.py torch --findings
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from leakfree._text import format_table
from leakfree.scan import scan
from leakfree.scan.rules import RULES

#: what docs/scan.md reports on: the packages with custom autograd Functions, trainers
#: that log losses, offloaders and pipelines
TARGETS = (
    "trl",
    "transformers",
    "torch.autograd",
    "torch/utils/checkpoint.py",
    "torch.distributed",
    "torchtune",
    "bitsandbytes",
    "peft",
    "accelerate",
    "lightning",
    "torch",
)


def _path(target: str) -> str | None:
    """``torch/utils/checkpoint.py`` style targets are files inside an installed package."""
    if "/" not in target:
        top = target.split(".")[0]
        return target if importlib.util.find_spec(top) is not None else None
    top, _, rest = target.partition("/")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / rest
    return str(path) if path.exists() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", default=list(TARGETS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--findings", action="store_true", help="print every finding")
    parser.add_argument("--json", default=str(HERE / "results" / "scan_real.json"))
    args = parser.parse_args(argv)
    codes = [r.code for r in RULES]
    rows, out = [], []
    for target in args.targets:
        path = _path(target)
        if path is None:
            print(f"{target}: not installed, skipped", file=sys.stderr)
            continue
        runs = [scan([path]) for _ in range(max(1, args.repeat))]
        result = runs[-1]
        speeds = sorted(r.files_per_second for r in runs)
        per_rule = {c: sum(f.rule == c for f in result.findings) for c in codes}
        median = statistics.median(speeds)
        rows.append(
            (
                target,
                str(result.files),
                *(str(per_rule[c]) for c in codes),
                f"{statistics.median(r.seconds for r in runs):.2f}",
                f"{median:.0f} ({speeds[0]:.0f}-{speeds[-1]:.0f})",
            )
        )
        out.append(
            {
                "target": target,
                "files": result.files,
                "unparsed": result.unparsed,
                "findings": per_rule,
                "seconds": [r.seconds for r in runs],
                "files_per_second": {"median": median, "min": speeds[0], "max": speeds[-1]},
                "listed": [str(f) for f in result.findings],
            }
        )
        if args.findings:
            for finding in result.findings:
                print(finding)
    header = ("target", "files", *codes, "seconds", "files/s (min-max)")
    print(format_table(header, rows, markdown=True))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"rules": codes, "results": out}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
