"""The scan's output formats: text (one line per finding), JSON, and SARIF 2.1.0 for
code-scanning UIs (GitHub code scanning and other SARIF viewers)."""

from __future__ import annotations

import json
from typing import Any

from leakfree.scan._run import ScanResult

__all__ = ["FORMATS", "render"]

FORMATS = ("text", "json", "sarif")
DOCS = "docs/scan.md"
_SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


def _summary(result: ScanResult) -> str:
    n = len(result.findings)
    files = f"{result.files} file{'s' if result.files != 1 else ''}"
    speed = f"{result.seconds:.2f} s, {result.files_per_second:.0f} files/s"
    head = f"{n} finding{'s' if n != 1 else ''} in {files} ({speed})"
    if result.unparsed:
        head += f"; {len(result.unparsed)} file(s) could not be parsed"
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
    lines.append(_summary(result))
    return "\n".join(lines)


def _json(result: ScanResult) -> dict[str, Any]:
    return {
        "findings": [
            {
                "path": f.path,
                "line": f.line,
                "column": f.col,
                "rule": f.rule,
                "symbol": f.symbol,
                "message": f.message,
            }
            for f in result.findings
        ],
        "files": result.files,
        "unparsed": result.unparsed,
        "seconds": round(result.seconds, 4),
        "rules": {
            r.code: {"name": r.name, "summary": r.summary, "confirm": r.confirm}
            for r in result.rules
        },
    }


def _sarif(result: ScanResult) -> dict[str, Any]:
    from leakfree import __version__

    index = {r.code: i for i, r in enumerate(result.rules)}
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
                                "defaultConfiguration": {"level": "warning"},
                            }
                            for r in result.rules
                        ],
                    }
                },
                "results": [
                    {
                        "ruleId": f.rule,
                        "ruleIndex": index.get(f.rule, -1),
                        "level": "warning",
                        "message": {"text": f"{f.symbol}: {f.message}"},
                        "locations": [
                            {
                                "physicalLocation": {
                                    "artifactLocation": {"uri": f.path},
                                    "region": {"startLine": f.line, "startColumn": f.col},
                                }
                            }
                        ],
                    }
                    for f in result.findings
                ],
            }
        ],
    }


def render(result: ScanResult, fmt: str) -> str:
    """``result`` in ``fmt`` (one of :data:`FORMATS`)."""
    if fmt == "text":
        return _text(result)
    if fmt == "json":
        return json.dumps(_json(result), indent=2)
    if fmt == "sarif":
        return json.dumps(_sarif(result), indent=2)
    raise ValueError(f"render(fmt={fmt!r}): expected one of {', '.join(FORMATS)}")
