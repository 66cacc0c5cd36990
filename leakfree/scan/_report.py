"""The scan's output formats: text (one line per finding), JSON, and SARIF 2.1.0 for
code-scanning UIs (GitHub code scanning and other SARIF viewers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from leakfree.scan._model import ScanRule
from leakfree.scan._run import ScanResult

FORMATS = ("text", "json", "sarif")
DOCS = "docs/scan.md"
_SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


def summary(result: ScanResult) -> str:
    """The report's last line: findings, notes, files, speed and unparsed files."""
    leaks, notes = len(result.leaks), len(result.findings) - len(result.leaks)
    files = f"{result.files} file{'s' if result.files != 1 else ''}"
    speed = f"{result.seconds:.2f} s, {result.files_per_second:.0f} files/s"
    head = f"{leaks} finding{'s' if leaks != 1 else ''}"
    if notes:
        head += f" and {notes} note{'s' if notes != 1 else ''}"
    head += f" in {files} ({speed})"
    if result.unparsed:
        head += (
            f"; {len(result.unparsed)} file(s) could not be parsed and were not checked "
            "(exit status 3 when nothing else is found)"
        )
    return head


def _text(result: ScanResult) -> str:
    lines = [str(f) for f in result.findings]
    lines += [f"not parsed: {u}" for u in result.unparsed]
    codes = sorted({f.rule for f in result.findings})
    if codes:
        confirm = {r.code: r.confirm for r in result.rules}
        lines.append("")
        lines += [f"{c}: confirm at run time with {confirm[c]}" for c in codes if c in confirm]
        lines.append(
            "suppress one finding with `# leakfree: ignore[CODE]` on its line; "
            f"rules and fixes: {DOCS}"
        )
    lines.append(summary(result))
    return "\n".join(lines)


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
            }
            for f in result.findings
        ],
        "files": result.files,
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
    raise ValueError(f"render(fmt={fmt!r}): expected one of {', '.join(FORMATS)}")
