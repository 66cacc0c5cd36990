"""Every ```python block in README.md and docs/*.md runs when pasted alone into a fresh
interpreter, so the documentation stays true and its examples are complete.

Each block is one test, run in a process of its own with an empty ``__main__`` namespace:
no prelude, so a block imports ``leakfree`` and builds its model and data itself. The
process is forked from multiprocessing's forkserver with torch preloaded (and nothing
else: leakfree is not even in ``sys.modules``), so a block costs a fork rather than a torch
import. It runs in a temporary directory, with one intra-op thread and a time limit; a
block that raises (or exits non-zero, or hangs) fails its test with its file:line and what
it printed, traceback included, with line numbers counted in the markdown file.

Blocks that import transformers, Lightning or TRL take seconds to import and are marked
``integration``. A block that cannot run on one CPU process says so where a reader sees it,
on the line before its fence, ``*Not run alone: why.*``, where *why* says what it needs
and names the script or test that runs that code instead; at most one block in five may
be skipped.
Shell blocks are install and CI commands: the demo and benchmark commands they name are
run by tests/test_cli.py.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests._fresh import PRELOAD

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(?:\*Not run alone: (?P<why>[^*]*)\.\*\n)?```python\n(?P<code>.*?)```", re.S)
# Seconds of import each: these blocks run in the whole suite, not the fast one.
_HEAVY = re.compile(r"^(?:from|import) (?:transformers|lightning|pytorch_lightning|trl)\b", re.M)
_PATH = re.compile(r"[\w./-]+\.py\b")  # a script or test named in a skip's reason
TIMEOUT = 60  # seconds per block

# The same server as tests/_fresh.py: torch imported, and nothing else.
_FORKSERVER = multiprocessing.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(PRELOAD)
# Started now, at collection: the server imports torch on the other core while the tests
# before these run, instead of at the first block (1.6 s of the fast suite's wall time).
multiprocessing.forkserver.ensure_running()

# What the forked child runs, given ``cwd``, ``path``, ``line`` and ``code``. Its target is
# the builtin ``exec`` with this source, not a function of this module: unpickling one
# would import this module, and pytest with it, into every child. Padding the code with
# ``line`` newlines makes a traceback name the markdown file's own line numbers.
_CHILD = """
import os, sys, traceback, types

import torch

torch.set_num_threads(1)
os.chdir(cwd)
out = os.open("output", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.dup2(out, 1)
os.dup2(out, 2)
main = types.ModuleType("__main__")
sys.modules["__main__"] = main
try:
    exec(compile("\\n" * line + code, path, "exec"), vars(main))
except SystemExit:
    raise
except BaseException as e:
    traceback.print_exception(e.with_traceback(e.__traceback__.tb_next))  # from the block on
    sys.exit(1)
"""


@dataclass(frozen=True)
class Block:
    """One ```python block of a markdown file."""

    path: Path
    line: int  # of the fence: the code starts on the next line
    code: str
    skip: str | None  # why, from the marker before the fence

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks() -> list[Block]:
    blocks = []
    for path in FILES:
        text = path.read_text()
        for m in _BLOCK.finditer(text):
            line = text[: m.start("code")].count("\n")
            blocks.append(Block(path, line, m["code"], m["why"]))
    return blocks


def _params() -> list[object]:
    params = []
    for block in _blocks():
        marks = [pytest.mark.skip(reason=block.skip)] if block.skip else []
        if _HEAVY.search(block.code):
            marks.append(pytest.mark.integration)
        params.append(pytest.param(block, id=block.where, marks=marks))
    return params


@pytest.mark.parametrize("block", _params())
def test_block_runs_alone(block: Block, tmp_path: Path) -> None:
    """The assertion is the run itself: a block that raises fails, as one that uses
    ``leakfree.`` without ``import leakfree`` does."""
    names = {"cwd": str(tmp_path), "path": str(block.path), "line": block.line, "code": block.code}
    child = _FORKSERVER.Process(target=exec, args=(_CHILD, names), name=block.where)
    child.start()
    child.join(TIMEOUT)
    timed_out = child.exitcode is None
    if timed_out:
        child.kill()
        child.join()
    output_file = tmp_path / "output"
    output = output_file.read_text() if output_file.exists() else ""
    if child.exitcode != 0:
        what = f"still running after {TIMEOUT} s" if timed_out else f"exit code {child.exitcode}"
        pytest.fail(f"{block.where}: the block failed alone ({what}):\n{output}", pytrace=False)


def test_every_python_block_is_collected() -> None:
    """The extractor sees every fence (a block it missed would silently go untested)."""
    for path in FILES:
        text = path.read_text()
        assert len(_BLOCK.findall(text)) == text.count("```python"), path


def test_few_blocks_are_skipped_and_each_names_what_runs_it() -> None:
    """At most one block in five is skipped, and each skip names an existing script or test
    that runs its code instead."""
    blocks = _blocks()
    skipped = [b for b in blocks if b.skip]
    assert len(skipped) <= len(blocks) // 5, (
        f"{len(skipped)} of {len(blocks)} blocks skipped: " + ", ".join(b.where for b in skipped)
    )
    for b in skipped:
        named = _PATH.findall(b.skip or "")
        assert named, f"{b.where}: the skip names no script or test that runs it: {b.skip!r}"
        for p in named:
            assert (ROOT / p).is_file(), f"{b.where}: the skip names {p}, which does not exist"
