"""``leakfree scan``: the command's parser and what it runs (:mod:`leakfree.scan`)."""

from __future__ import annotations

import argparse
import os
import sys


def add_parser(
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


def run_scan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
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
