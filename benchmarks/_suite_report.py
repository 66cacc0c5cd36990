"""The GPU suite's record: its JSON file, and each part's time box.

The file is rewritten whole (written beside, then renamed over it) as a part begins
(``running`` names it), whenever the part keeps what it has so far (``partial``: true),
and as it ends, so a run killed at any point, or a process that aborts, leaves a readable
file with every finished part and what the running one had measured.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from _common import environment


class Report:
    """The JSON file at ``path``; ``header`` goes at its top."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.payload: dict[str, Any] = {
            "benchmark": "gpu_suite",
            "environment": environment(),
            **header,
            "parts_done": [],
            "running": None,
            "parts": {},
            "checks": [],
        }
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self) -> None:
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(self.payload, indent=2, default=str) + "\n")
        os.replace(partial, self.path)

    def begin(self, part: str) -> None:
        self.payload["running"] = part
        self.write()

    def keep(self, part: str, result: dict[str, Any]) -> None:
        self.payload["parts"][part] = {**result, "partial": True}
        self.write()

    def end(self, part: str, result: dict[str, Any], checks: list[dict[str, str]]) -> None:
        self.payload["parts"][part] = result
        self.payload["parts_done"].append(part)
        self.payload["checks"] += checks
        self.payload["running"] = None
        self.write()


class TimeBox:
    """One part's time (``budget`` seconds from now) and its results so far: a part asks
    :meth:`over` before each step it could leave out, and :meth:`keep` writes what it has."""

    def __init__(self, report: Report, part: str, budget: float) -> None:
        self.report, self.part, self.budget = report, part, budget
        self.start = time.perf_counter()

    def over(self) -> bool:
        return time.perf_counter() - self.start > self.budget

    def keep(self, result: dict[str, Any]) -> None:
        self.report.keep(self.part, result)

    def seconds(self) -> float:
        return time.perf_counter() - self.start
