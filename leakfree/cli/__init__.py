"""The command line: ``python -m leakfree`` (or the ``leakfree`` command).

Subcommands:
    doctor                installed versions, known leaks that affect them, what patch_all() does
    demo                  the five leak shapes naive vs leakfree: bytes per step, and a plot
    snapshot FILE [FILE2] analyse a torch.cuda.memory._snapshot() pickle, or diff two
    scan PATH_OR_PACKAGE  find autograd lifetime leaks in source code (ast only; exit 1 on
                          findings, 0 when clean, 2 on usage errors, 3 on files not parsed)
    run [opts] SCRIPT     run a training script unchanged with the leak finders on (or
                          -m MODULE); the script's exit status (--fail: 79 on a leak)

Each subcommand is a module of this package (``run``, ``demo``, ``doctor``, ``scan``);
``snapshot`` is :mod:`leakfree.diagnostics.snapshot`'s own ``main``.
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

    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["run"]:  # the script's own arguments are not ours to parse
        from leakfree.cli.run import main as run_main

        return run_main(words[1:], _prog())

    parser = argparse.ArgumentParser(
        prog=_prog(),
        description="leakfree: autograd object lifetimes done right.",
    )
    parser.add_argument("--version", action="version", version=f"leakfree {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="installed versions, known leaks, what patch_all() would do")
    sub.add_parser(
        "run",
        help="run a training script unchanged, with the leak finders on",
        add_help=False,
    )
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
    from leakfree.cli.scan import add_parser, run_scan

    scan = add_parser(sub)
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] == ["snapshot"]:
        # argparse would report the missing FILE before an unknown option: name the option
        unknown = [a for a in given[1:] if a.startswith("-") and a not in ("-h", "--help")]
        if unknown:
            snap.error(f"unknown option {unknown[0]} (snapshot takes FILE, or two to diff)")
    args = parser.parse_args(given)
    if args.command == "scan":
        return run_scan(args, scan)
    if args.command == "doctor":
        from leakfree.cli.doctor import run_doctor

        return run_doctor()
    if args.command == "demo":
        from leakfree.cli.demo import run_demo

        if args.steps < 3:
            parser.error("--steps must be at least 3")
        return run_demo(steps=args.steps, plot=args.plot or None)
    if len(args.files) > 2:
        snap.error("snapshot takes one file, or two to diff")
    from leakfree.diagnostics.snapshot import main as snapshot_main

    return snapshot_main(list(args.files))
