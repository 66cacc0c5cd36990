"""``python -m leakfree`` (or the ``leakfree`` command).

Subcommands:
    doctor                installed versions, known leaks that affect them, what patch_all() does
    demo                  the five leak shapes naive vs leakfree: bytes per step, and a plot
    snapshot FILE [FILE2] analyse a torch.cuda.memory._snapshot() pickle, or diff two
    scan PATH_OR_PACKAGE  find autograd lifetime leaks in source code (ast only; exit 1 on
                          findings, 0 when clean, 2 on usage errors, 3 on files not parsed)
    run [opts] SCRIPT     run a training script unchanged with the leak finders on (or
                          -m MODULE); the script's exit status (--fail: 79 on a leak)
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
        from leakfree._run import main as run_main

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
    scan = _scan_parser(sub)
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] == ["snapshot"]:
        # argparse would report the missing FILE before an unknown option: name the option
        unknown = [a for a in given[1:] if a.startswith("-") and a not in ("-h", "--help")]
        if unknown:
            snap.error(f"unknown option {unknown[0]} (snapshot takes FILE, or two to diff)")
    args = parser.parse_args(given)
    if args.command == "scan":
        return _scan(args, scan)
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


def _scan_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """The ``scan`` command's parser, among ``sub``'s."""
    from leakfree.scan._run import EXIT_STATUSES

    scan = sub.add_parser(
        "scan",
        help="find autograd lifetime leaks in source code, without running or importing it",
        description="Find autograd lifetime leaks in Python source, read with ast only "
        "(nothing is imported). Suppress one finding with `# leakfree: ignore[LF001]` on "
        "its line.",
        epilog="exit status:\n"
        + "\n".join(f"  {code}  {meaning}" for code, meaning in EXIT_STATUSES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    scan.add_argument(
        "paths",
        nargs="*",
        metavar="PATH_OR_PACKAGE",
        help="files, folders, or installed packages by import name (located, never imported)",
    )
    scan.add_argument("--format", choices=("text", "json", "sarif", "github"), default="text")
    scan.add_argument("--select", default="", help="rule codes or prefixes, comma-separated")
    scan.add_argument("--ignore", default="", help="rule codes or prefixes to skip")
    scan.add_argument(
        "--exclude", action="append", default=[], metavar="GLOB", help="skip matching paths"
    )
    scan.add_argument("--output", "-o", default=None, help="write the report here")
    scan.add_argument(
        "--jobs", "-j", type=int, default=None, help="processes (default: one per CPU)"
    )
    scan.add_argument(
        "--baseline",
        default=None,
        metavar="FILE",
        help="a JSON report of an earlier scan: report only findings it does not list",
    )
    scan.add_argument("--list-rules", action="store_true", help="print the rules and exit")
    return scan


def _scan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from leakfree.scan import render, scan
    from leakfree.scan._locate import UsageError
    from leakfree.scan._report import summary
    from leakfree.scan.rules import RULES

    if args.list_rules:
        for rule in RULES:
            print(f"{rule.code}  {rule.name}: {rule.summary} (confirm: {rule.confirm})")
        return 0
    if not args.paths:
        parser.error("give at least one PATH_OR_PACKAGE (or --list-rules)")
    try:
        result = scan(
            args.paths,
            select=args.select.split(","),
            ignore=args.ignore.split(","),
            exclude=args.exclude,
            jobs=args.jobs,
            baseline=args.baseline,
        )
    except UsageError as e:
        parser.error(str(e))  # exit status 2
    report = render(result, args.format)
    try:
        if args.output:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(report + "\n")
            print(f"{summary(result)}; report written to {args.output}")
        else:
            print(report, flush=True)
    except BrokenPipeError:
        # the reader left (`leakfree scan ... | head`): stop quietly, as `cat` does, and
        # keep the interpreter from failing again when it flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return result.status


if __name__ == "__main__":
    sys.exit(main())
