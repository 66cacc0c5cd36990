"""Delete leakfree's synchronisation statements one at a time and see which test notices.

    python -m tests.simdev.mutate [--json out.json] [--tests tests/test_streams.py]

A mutant removes one statement that orders or protects device work, or waits for it: a
call of ``wait_stream``, ``wait_event``, ``record_stream``, ``synchronize``, ``query``,
``wait`` (an event's, a collective's) or ``use_here`` (offload's wait-and-record helper), or an
event record (``event = ....record_event()`` becomes ``event = None``; ``x.event = e``
is dropped). For each, the stream tests run against the mutated source (in a copy of the
package, so the working tree is never touched) and the first failing test is reported.
A mutant no test kills is a missing test or a statement that is not needed.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: every module of the package: a synchronisation statement anywhere in it is a target
TARGETS = tuple(sorted(str(p.relative_to(ROOT)) for p in (ROOT / "leakfree").rglob("*.py")))
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")
_CALLS = {"wait_stream", "wait_event", "record_stream", "synchronize", "query", "wait", "use_here"}


@dataclass
class Mutant:
    path: str
    line: int
    statement: str
    replacement: str
    killed_by: str | None = None


def _called(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def find(path: str) -> list[Mutant]:
    source = (ROOT / path).read_text()
    lines = source.splitlines()
    mutants: list[Mutant] = []
    for node in ast.walk(ast.parse(source)):
        text = lines[node.lineno - 1].strip() if hasattr(node, "lineno") else ""
        if isinstance(node, ast.Expr) and _called(node.value) in _CALLS:
            mutants.append(Mutant(path, node.lineno, text, "pass"))
        elif isinstance(node, ast.Assign) and _called(node.value) == "record_event":
            target = ast.unparse(node.targets[0])
            mutants.append(Mutant(path, node.lineno, text, f"{target} = None"))
        elif (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Attribute)
            and node.targets[0].attr == "event"
            and not (isinstance(node.value, ast.Constant) and node.value.value is None)
        ):
            mutants.append(Mutant(path, node.lineno, text, "pass"))
        elif (
            isinstance(node, ast.Return)
            and node.value is not None
            and any(_called(n) == "query" for n in ast.walk(node.value))
        ):  # HostBlock.ready: "has its last copy completed?" asks the event
            mutants.append(Mutant(path, node.lineno, text, "return True"))
    return sorted(mutants, key=lambda m: (m.path, m.line))


def run(mutant: Mutant, tests: list[str]) -> str | None:
    with tempfile.TemporaryDirectory() as tmp:
        # A whole copy: pytest puts the rootdir first on sys.path, so the package under
        # test must be the mutated one in that rootdir.
        # (the docs, examples and benchmarks too: the docs tests run their code blocks)
        for name in ("leakfree", "tests", "docs", "examples", "benchmarks"):
            shutil.copytree(ROOT / name, Path(tmp) / name, ignore=_IGNORE)
        for name in ("pyproject.toml", "leakfree_pytest_plugin.py", "README.md"):
            shutil.copy(ROOT / name, Path(tmp) / name)
        target = Path(tmp) / mutant.path
        lines = target.read_text().splitlines(keepends=True)
        old = lines[mutant.line - 1]
        indent = old[: len(old) - len(old.lstrip())]
        lines[mutant.line - 1] = f"{indent}{mutant.replacement}  # MUTANT\n"
        target.write_text("".join(lines))
        env = dict(os.environ, PYTHONPATH=tmp)
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
    if proc.returncode == 0:
        return None
    for line in proc.stdout.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ")[0]
    return f"exit status {proc.returncode}"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.simdev.mutate")
    parser.add_argument("--tests", nargs="*", default=["tests/test_streams.py"])
    parser.add_argument("--json", help="write the table here too")
    parser.add_argument("--line", type=int, action="append", help="only the mutant(s) here")
    args = parser.parse_args()
    mutants = [m for path in TARGETS for m in find(path)]
    if args.line:
        mutants = [m for m in mutants if m.line in args.line]
    for m in mutants:
        m.killed_by = run(m, args.tests)
        verdict = m.killed_by or "SURVIVED"
        print(f"{m.path}:{m.line}  {m.statement}\n    -> {verdict}", flush=True)
    survivors = [m for m in mutants if m.killed_by is None]
    print(f"{len(mutants) - len(survivors)}/{len(mutants)} mutants killed")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(m) for m in mutants], indent=2))
    return 1 if survivors else 0


if __name__ == "__main__":
    raise SystemExit(main())
