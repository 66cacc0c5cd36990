"""The scan's output formats: text (findings grouped by file and by the Function or
container that holds the memory, one line of evidence each, then counts by rule), JSON,
SARIF 2.1.0 for code-scanning UIs, and GitHub Actions workflow commands (``::warning
file=...``), which a workflow step turns into annotations on a pull request."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from leakfree.scan._model import NOTE, ScanFinding, ScanRule
from leakfree.scan._run import ScanResult

FORMATS = ("text", "json", "sarif", "github")
DOCS = "docs/scan.md"
_SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
#: rules whose symbol is ``Owner.attr``: grouped under the owner (a Function, a manager)
_OWNED = ("LF001", "LF002", "LF004")


def summary(result: ScanResult) -> str:
    """The report's last line: findings, notes, files, speed and unparsed files."""
    leaks, notes = len(result.leaks), len(result.findings) - len(result.leaks)
    files = f"{result.files} file{'s' if result.files != 1 else ''}"
    speed = f"{result.seconds:.2f} s, {result.files_per_second:.0f} files/s"
    head = f"{leaks} finding{'s' if leaks != 1 else ''}"
    if notes:
        head += f" and {notes} note{'s' if notes != 1 else ''}"
    head += f" in {files} ({speed})"
    if result.baselined:
        head += f"; {result.baselined} more listed in the baseline, left out"
    if result.unparsed:
        head += (
            f"; {len(result.unparsed)} file(s) could not be parsed and were not checked "
            "(exit status 3 when nothing else is found)"
        )
    return head


def _holder(f: ScanFinding) -> tuple[str, str]:
    """(what holds the memory, the item of it): ``("Gather", "for_backwards")`` for
    ``Gather.for_backwards``; a container (``self.history``) is its own holder."""
    owner, _, item = f.symbol.rpartition(".")
    if f.rule in _OWNED and owner:
        return owner, item
    return f.symbol, ""


def _text(result: ScanResult) -> str:
    lines: list[str] = []
    by_file: dict[str, list[ScanFinding]] = {}
    for f in result.findings:
        by_file.setdefault(f.path, []).append(f)
    for path, found in by_file.items():
        lines.append(path)
        groups: dict[str, list[ScanFinding]] = {}
        for f in found:
            groups.setdefault(_holder(f)[0], []).append(f)
        for holder, members in groups.items():
            lines.append(f"  {holder}")
            for f in members:
                item = _holder(f)[1]
                level = " (note)" if f.level == NOTE else ""
                what = f"{item}: " if item else ""
                lines.append(
                    f"    {f.line}:{f.col} {f.rule}{level} {what}{f.evidence or f.message}"
                )
    lines += [f"not parsed: {u}" for u in result.unparsed]
    if result.findings:
        lines += ["", *_counts(result)]
        lines.append(
            "suppress one finding with `# leakfree: ignore[CODE]` on its line; "
            f"rules and fixes: {DOCS}"
        )
    lines.append(summary(result))
    return "\n".join(lines)


def _counts(result: ScanResult) -> list[str]:
    """Per rule found: how many warnings and notes, the fix, how to confirm at run time."""
    rules = {r.code: r for r in result.rules}
    warnings = Counter(f.rule for f in result.findings if f.level != NOTE)
    notes = Counter(f.rule for f in result.findings if f.level == NOTE)
    out = []
    for code in sorted(warnings.keys() | notes.keys()):
        rule = rules.get(code)
        name = f" {rule.name}" if rule is not None else ""
        n, m = warnings[code], notes[code]
        counts = f"{n} warning{'s' if n != 1 else ''}" + (
            f", {m} note{'s' if m != 1 else ''}" if m else ""
        )
        out.append(f"{code}{name}: {counts}")
        if rule is not None and rule.fix:
            out.append(f"  fix: {rule.fix}")
        if rule is not None:
            out.append(f"  confirm at run time with {rule.confirm}")
    return out


def _json(result: ScanResult) -> dict[str, Any]:
    return {
        "findings": [
            {
                "path": f.path,
                "line": f.line,
                "column": f.col,
                "rule": f.rule,
                "level": f.level,
                "symbol": f.symbol,
                "message": f.message,
                "evidence": f.evidence,
            }
            for f in result.findings
        ],
        "files": result.files,
        "baselined": result.baselined,
        "unparsed": result.unparsed,
        "status": result.status,
        "seconds": round(result.seconds, 4),
        "rules": {
            r.code: {
                "name": r.name,
                "summary": r.summary,
                "confirm": r.confirm,
                "help": help_uri(r),
            }
            for r in result.rules
        },
    }


def help_uri(rule: ScanRule) -> str:
    """Where a rule is documented: docs/scan.md's section on it, as a file URI of the docs
    beside the package (a source checkout or an editable install), else the path in the
    project's repository (``docs/scan.md#lf001-...``)."""
    anchor = _ANCHORS.get(rule.code, "the-rules")
    docs = Path(__file__).resolve().parents[2] / DOCS
    if docs.is_file():
        return f"{docs.as_uri()}#{anchor}"
    return f"{DOCS}#{anchor}"


#: docs/scan.md's section of each rule
_ANCHORS = {
    "LF001": "lf001-ctx-state-that-outlives-backward",
    "LF002": "lf002-an-output-stored-on-ctx",
    "LF003": "lf003-a-loss-kept-with-its-graph-in-a-container-that-outlives-the-step",
    "LF004": "lf004-a-pack-hook-that-returns-a-key-into-a-long-lived-table",
    "LF005": "lf005-a-receive-buffer-made-an-autograd-leaf-inside-a-loop",
}


def _base_ids(result: ScanResult) -> dict[str, str]:
    """Absolute base folder -> its SARIF uriBaseId: ``SRCROOT`` for the working directory,
    ``ROOT1``, ``ROOT2``... for others (the site-packages folder of a package scanned by
    name)."""
    cwd = str(Path.cwd().resolve())
    ids = {cwd: "SRCROOT"}
    for base in sorted(set(result.bases.values())):
        ids.setdefault(base, f"ROOT{len(ids)}")
    return ids


def _location(
    path: str, result: ScanResult, ids: dict[str, str], line: int = 0, col: int = 0
) -> dict[str, Any]:
    base = result.bases.get(path)
    artifact: dict[str, Any] = {"uri": Path(path).as_posix()}
    if base is not None and not Path(path).is_absolute():
        artifact["uriBaseId"] = ids[base]
    physical: dict[str, Any] = {"artifactLocation": artifact}
    if line:
        physical["region"] = {"startLine": line, "startColumn": col}
    return {"physicalLocation": physical}


def _sarif(result: ScanResult) -> dict[str, Any]:
    from leakfree import __version__

    index = {r.code: i for i, r in enumerate(result.rules)}
    ids = _base_ids(result)
    used = {ids[b] for b in result.bases.values()} | {"SRCROOT"}
    notifications = [
        {
            "level": "error",
            "message": {"text": f"not parsed, so not checked: {u}"},
            "locations": [_location(u.split(": ", 1)[0], result, ids)],
        }
        for u in result.unparsed
    ]
    return {
        "$schema": _SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "leakfree",
                        "version": __version__,
                        "rules": [
                            {
                                "id": r.code,
                                "name": r.name,
                                "shortDescription": {"text": r.summary},
                                "help": {"text": f"Confirm at run time with {r.confirm}."},
                                "helpUri": help_uri(r),
                                "defaultConfiguration": {"level": "warning"},
                            }
                            for r in result.rules
                        ],
                    }
                },
                "originalUriBaseIds": {
                    name: {"uri": Path(base).as_uri() + "/"}
                    for base, name in ids.items()
                    if name in used
                },
                "invocations": [
                    {
                        "executionSuccessful": True,
                        "exitCode": result.status,
                        "toolExecutionNotifications": notifications,
                    }
                ],
                "results": [
                    {
                        "ruleId": f.rule,
                        "ruleIndex": index.get(f.rule, -1),
                        "level": f.level,
                        "message": {"text": f"{f.symbol}: {f.message}"},
                        "locations": [_location(f.path, result, ids, f.line, f.col)],
                    }
                    for f in result.findings
                ],
            }
        ],
    }


def _github(result: ScanResult) -> str:
    """GitHub Actions workflow commands: one annotation per finding (``::warning`` for a
    leak, ``::notice`` for a note) and per file not parsed (``::error``), then the summary."""
    lines = []
    for f in result.findings:
        kind = "notice" if f.level == NOTE else "warning"
        props = (
            f"file={_prop(f.path)},line={f.line},col={f.col},title={_prop(f'{f.rule} {f.symbol}')}"
        )
        lines.append(f"::{kind} {props}::{_data(f.message)}")
    for u in result.unparsed:
        path, _, why = u.partition(": ")
        lines.append(f"::error file={_prop(path)},title=not parsed::{_data(why)}")
    lines.append(summary(result))
    return "\n".join(lines)


def _data(text: str) -> str:
    """A workflow command's message, escaped as the runner reads it."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _prop(text: str) -> str:
    """A workflow command's property value, escaped as the runner reads it."""
    return _data(text).replace(":", "%3A").replace(",", "%2C")


def render(result: ScanResult, fmt: str) -> str:
    """``result`` in ``fmt`` (one of :data:`FORMATS`)."""
    if not isinstance(result, ScanResult):
        raise TypeError(f"render(result={result!r}): expected a ScanResult, as scan() returns")
    if fmt == "text":
        return _text(result)
    if fmt == "json":
        return json.dumps(_json(result), indent=2)
    if fmt == "sarif":
        return json.dumps(_sarif(result), indent=2)
    if fmt == "github":
        return _github(result)
    raise ValueError(f"render(fmt={fmt!r}): expected one of {', '.join(FORMATS)}")
