"""A baseline: the findings a team has already seen, left out of the next scans so that
only what is new is reported (``leakfree scan src/ --baseline leakfree-baseline.json``).

A baseline is any JSON report of the scan (``leakfree scan src/ --format json -o
leakfree-baseline.json``): its ``findings``, each matched by rule, path and symbol
(``LF001``, ``pkg/ops.py``, ``Gather.for_backwards``), never by line or column, so code
moved up or down keeps matching. Each entry covers one finding: two findings of the same
key need two entries. Paths are compared as the scan shows them (relative to the folder
or package scanned), so scan the same targets from the same place that wrote the baseline.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from leakfree.scan._locate import UsageError
from leakfree.scan._model import ScanFinding

#: what identifies a finding across edits: (rule, path, symbol)
Key = tuple[str, str, str]


def key(finding: ScanFinding) -> Key:
    return finding.rule, Path(finding.path).as_posix(), finding.symbol


def load(path: str | os.PathLike[str]) -> Counter[Key]:
    """The keys a baseline file lists, with how many times each. Raises
    :class:`~leakfree.scan._locate.UsageError` for a file that does not exist or is not a
    scan's JSON report."""
    shown = os.fspath(path)
    how = "write one with `leakfree scan PATH --format json -o FILE`"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"scan(baseline={shown!r}): no such file; {how}") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"scan(baseline={shown!r}): not readable JSON ({e}); {how}") from None
    entries = data.get("findings") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and {"rule", "path", "symbol"} <= e.keys() for e in entries
    ):
        raise UsageError(
            f"scan(baseline={shown!r}): no list of findings with rule, path and symbol; {how}"
        )
    return Counter((e["rule"], Path(e["path"]).as_posix(), e["symbol"]) for e in entries)


def new_only(findings: Iterable[ScanFinding], known: Counter[Key]) -> tuple[list[ScanFinding], int]:
    """The findings the baseline does not cover (in order), and how many it covered."""
    left = Counter(known)
    out: list[ScanFinding] = []
    covered = 0
    for f in findings:
        k = key(f)
        if left[k] > 0:
            left[k] -= 1
            covered += 1
        else:
            out.append(f)
    return out, covered
