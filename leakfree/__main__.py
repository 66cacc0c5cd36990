"""``python -m leakfree``: command-line entry point.

Subcommands:
    demo    run the leak shapes naive vs leakfree and print bytes retained per step
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m leakfree", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="show the leaks and leakfree's fixes, naive vs leakfree")
    demo.add_argument("--steps", type=int, default=20, help="training steps per run")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from leakfree._demo import run_demo

        return run_demo(steps=args.steps)
    return 2  # pragma: no cover  (argparse rejects unknown commands)


if __name__ == "__main__":
    sys.exit(main())
