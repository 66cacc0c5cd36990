"""``leakfree scan``: find autograd lifetime leaks in source code, before they run.

Reads Python files with :mod:`ast` only: nothing scanned is imported or executed, so a
package that needs CUDA to import (Transformer Engine) scans on any machine. One rule per
leak shape (:data:`~leakfree.scan.rules.RULES`); each finding names what holds the memory
and the runtime tool that confirms it (``find_retained``, ``assert_no_leak``).

    python -m leakfree scan transformer_engine src/ --format json

Exit status: 1 when there are findings, 0 when clean, 2 on usage errors. Rules and fixes:
docs/scan.md.
"""

from __future__ import annotations

from leakfree.scan._model import ScanFinding
from leakfree.scan._report import render
from leakfree.scan._run import ScanResult, scan

__all__ = [
    "ScanFinding",
    "ScanResult",
    "render",
    "scan",
]
