"""How a ``leakfree run --json`` report is read against the corpus manifest: whether the
holder is named, whether the line that made what it keeps is cited, whether a filled store is
reported as grown then flat. Used by the tests and by measure.py, so both read a report the
same way. Standard library only.

A holder counts only where leakfree names it as one: a holder's path, a cycle's path, or a
line of the finding's message with its creation sites taken out. A creation site
(``created at FILE:LINE in FUNCTION``, ``(from FILE:LINE in FUNCTION)``) names the function
that made a tensor, not what holds it: ``in Window.features`` there does not name the cache
of ``Window.features``, and a script's file name (``window_cache_leak.py``) does not say
"cache".
"""

from __future__ import annotations

import re
from typing import Any

from tests.integration.corpus.manifest import Case

_SITE = re.compile(r"(\(from |created at )?\S+\.py:\d+ in [^\s,)]+\)?")
#: the final report's wording for growth that stopped (the runtime-finders work item)
GREW_THEN_FLAT = re.compile(r"grew by (.+?) over steps (\d+)-(\d+), then flat for (\d+) steps")


def findings(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's findings, its children's included."""
    found = list(report.get("findings", []))
    for child in report.get("children", []):
        found += child.get("findings", [])
    return found


def holder_lines(report: dict[str, Any]) -> list[str]:
    """Every text that names a holder: holders' paths, cycles, and the findings' message lines
    with their creation sites taken out."""
    lines: list[str] = []
    for f in findings(report):
        lines += [str(h.get("where", "")) for h in f.get("holders", [])]
        if f.get("cycle"):
            lines.append(str(f["cycle"]))
        lines += [_SITE.sub("", line) for line in str(f.get("message", "")).splitlines()]
    return lines


def holder_named(case: Case, report: dict[str, Any]) -> bool:
    """Whether one holder text matches ``case.holder`` and every ``case.says`` is said."""
    lines = holder_lines(report)
    text = "\n".join(lines)
    if not any(re.search(case.holder, line) for line in lines):
        return False
    return all(re.search(pattern, text) for pattern in case.says)


def site_text(report: dict[str, Any]) -> str:
    """The findings' messages and their holders' creation sites."""
    parts = []
    for f in findings(report):
        parts.append(str(f.get("message", "")))
        parts += [str(h.get("created_at", "")) for h in f.get("holders", [])]
    return "\n".join(parts)


def made_site(case: Case) -> str:
    """The creation site of the case's ``# MADE`` line, as a report writes it."""
    return f"{case.name}.py:{case.made_line()} in {case.made_in}"


def line_cited(case: Case, report: dict[str, Any]) -> bool:
    """Whether a finding cites the ``# MADE`` line (file, line and function)."""
    cited = rf"(?<![\w.]){re.escape(made_site(case))}(?![\w.])"
    return re.search(cited, site_text(report)) is not None


def grew_then_flat(text: str) -> tuple[str, int, int, int] | None:
    """``(bytes, first step, last step, flat steps)`` of a ``grew by ... then flat`` report."""
    said = GREW_THEN_FLAT.search(text)
    if said is None:
        return None
    grown, first, last, flat = said.groups()
    return grown, int(first), int(last), int(flat)
