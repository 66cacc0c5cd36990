"""``leakfree.patch_all()``: lazy, version-gated, reversible repairs of known leaks.

Each integration (``transformer_engine``, ``trl``) is a module holding a table of
:class:`~leakfree.patches._registry.Patch` records; one registry applies them:

* when the target module is first imported (a post-import hook), or at once if it is;
* only on affected versions (read from package metadata, never by importing the
  library), and only if the code is the code the patch expects (else it warns with
  :class:`leakfree.PatchWarning` and skips; ``strict=True`` raises instead);
* idempotently, thread-safely, reversibly (``unpatch_all()`` puts back the exact original
  objects), and it says what it did (``patch_report()``).

Importing :mod:`leakfree` imports neither Transformer Engine nor TRL.
"""

from __future__ import annotations

from typing import Any

from leakfree._warnings import PatchWarning
from leakfree.patches import transformer_engine as _te
from leakfree.patches import trl as _trl
from leakfree.patches._registry import Patch, PatchRecord, PatchReport, Registry
from leakfree.patches.sweep import Sweep, active_sweeps, patch_functions, remove_all_sweeps

__all__ = [
    "Patch",
    "PatchRecord",
    "PatchReport",
    "PatchWarning",
    "Sweep",
    "patch_all",
    "patch_functions",
    "patch_report",
    "unpatch_all",
]

REGISTRY = Registry((*_te.PATCHES, *_trl.PATCHES))


def patch_all(*, strict: bool = False, **only: Any) -> PatchReport:
    """Apply every known repair that fits the installed versions; return the report.

    Keyword arguments select: ``patch_all(trl=False)`` skips an integration,
    ``patch_all(trl="always")`` applies TRL's patches on any version,
    ``patch_all(transformer_engine="harden")`` also releases the op fuser's per-op contexts,
    ``patch_all(transformer_engine_fuser=False)`` skips one patch. Unknown keys raise
    ``TypeError`` before anything changes. Call it at startup, before or after importing
    the libraries: patches wait for their module to be imported.
    """
    chosen = REGISTRY.select(only)
    REGISTRY.request(chosen, strict)
    return patch_report()


def unpatch_all() -> PatchReport:
    """Revert every applied patch (and every ``patch_functions`` sweep) to the originals."""
    REGISTRY.revert_all()
    remove_all_sweeps()
    return patch_report()


def patch_report() -> PatchReport:
    """What was applied, what is waiting for an import, what was skipped and why."""
    report = REGISTRY.report()
    for sweep in active_sweeps():
        report.append(
            PatchRecord(
                f"sweep.{sweep.prefix}",
                "sweep",
                f"{len(sweep.handles)} Function classes",
                None,
                "applied",
                "ctx state released after the last backward",
            )
        )
    return report
