"""What the rule tests share: the stand-in cases, parsed sources, a project of them."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

from leakfree.scan._model import Project, Source

#: the stand-in sources (data, never imported): the real code shapes, leaky and fixed
CASES = Path(__file__).parent / "scan_cases"


def source(path: str, text: str) -> Source:
    """``text`` (dedented) parsed as the file ``path``."""
    text = textwrap.dedent(text)
    return Source(path, text, ast.parse(text))


def project_of(*sources: Source) -> Project:
    """A project holding ``sources``, for rules that follow helpers across files."""
    project = Project()
    for s in sources:
        project.add(s)
    return project


def line_of(text: str, snippet: str) -> int:
    """The one line of ``text`` containing ``snippet``."""
    (hit,) = [i for i, line in enumerate(text.splitlines(), 1) if snippet in line]
    return hit
