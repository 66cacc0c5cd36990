"""``python -m leakfree`` (or the ``leakfree`` command).

Subcommands:
    doctor                installed versions, known leaks that affect them, what patch_all() does
    demo                  the five leak shapes naive vs leakfree: bytes per step, and a plot
    snapshot FILE [FILE2] analyse a torch.cuda.memory._snapshot() pickle, or diff two
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

# Nothing here imports torch until a subcommand runs: --help, --version and usage errors
# answer at once (leakfree's package __init__ is lazy too).


def _prog() -> str:
    """How the user invoked us: the console script, or ``python -m leakfree``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m leakfree" if name in ("__main__.py", "-c", "") else "leakfree"


def main(argv: Sequence[str] | None = None) -> int:
    from leakfree import __version__

    parser = argparse.ArgumentParser(
        prog=_prog(),
        description="leakfree: autograd object lifetimes done right.",
    )
    parser.add_argument("--version", action="version", version=f"leakfree {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="installed versions, known leaks, what patch_all() would do")
    demo = sub.add_parser("demo", help="the five leak shapes, naive vs leakfree")
    demo.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    demo.add_argument(
        "--out",
        "--plot",
        dest="plot",
        default="leakfree-demo.png",
        help="where to write the PNG (default leakfree-demo.png; '' for none)",
    )
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
        snap.error("snapshot takes one file, or two to diff")
    from leakfree.diagnostics.snapshot import main as snapshot_main

    return snapshot_main(list(args.files))


if __name__ == "__main__":
    sys.exit(main())
