"""``python -m leakfree`` (or the ``leakfree`` command).

Subcommands:
    doctor                installed versions, known leaks that affect them, what patch_all() does
    demo                  the five leak shapes naive vs leakfree: bytes per step, and a plot
    snapshot FILE [FILE2] analyse a torch.cuda.memory._snapshot() pickle, or diff two
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m leakfree",
        description="leakfree: autograd object lifetimes done right.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="installed versions, known leaks, what patch_all() would do")
    demo = sub.add_parser("demo", help="the five leak shapes, naive vs leakfree")
    demo.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    demo.add_argument("--plot", default="leakfree-demo.png", help="PNG to write ('' for none)")
    snap = sub.add_parser("snapshot", help="analyse a CUDA memory snapshot, or diff two")
    snap.add_argument("files", nargs="+", metavar="FILE", help="one snapshot, or two to diff")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from leakfree._doctor import run_doctor

        return run_doctor()
    if args.command == "demo":
        from leakfree._demo import run_demo

        if args.steps < 3:
            parser.error("--steps must be at least 3")
        return run_demo(steps=args.steps, plot=args.plot or None)
    if len(args.files) > 2:
        parser.error("snapshot takes one file, or two to diff")
    from leakfree.diagnostics.snapshot import main as snapshot_main

    return snapshot_main(list(args.files))


if __name__ == "__main__":
    sys.exit(main())
