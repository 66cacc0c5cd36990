"""``leakfree.patch_all()``: lazy, version-gated, reversible repairs of known leaks.

Each integration (``transformer_engine``, ``trl``, ``torchtune``, ``torch_pipelining``:
``torch.distributed.pipelining``) is a module holding a table of
:class:`~leakfree.patches._registry.Patch` records; one registry applies them:

* when the target module is first imported (a post-import hook), or at once if it is;
* only on affected versions (read from package metadata, never by importing the
  library), and only if the code is the code the patch expects (else it warns with
  :class:`leakfree.PatchWarning` and skips; ``strict=True`` raises instead);
* idempotently, thread-safely, reversibly: the registry keeps the original of everything
  it changed in one table (:func:`get_original`, :func:`is_object_patched`) until
  ``unpatch_all()`` puts those exact objects back; and it says what it did
  (``patch_report()``: per record an :class:`Outcome`, the :class:`Reason` for it, and a
  detail in words).

``patch_functions`` sweeps are records of the same registry, applied by the same
post-import hooks, their originals in the same table. Importing :mod:`leakfree` imports
none of Transformer Engine, TRL or torchtune.

The public names are in ``__all__``; the machinery stays in its own modules
(``_registry``: ``Patch``, ``Registry``, ``REGISTRY``, ``PAIRS``; ``sweep``: ``Sweep``,
``active_sweeps``, ``remove_all_sweeps``).
"""

from __future__ import annotations

from typing import Any

import leakfree._args as _args
from leakfree.errors import PatchError, PatchWarning
from leakfree.patches import pipelining as _pipelining
from leakfree.patches import torchtune as _torchtune
from leakfree.patches import transformer_engine as _te
from leakfree.patches import trl as _trl
from leakfree.patches._registry import (
    REGISTRY,
    Outcome,
    PatchReport,
    Reason,
    get_original,
    is_object_patched,
)
from leakfree.patches._registry import (
    PatchRecord as PatchRecord,
)
from leakfree.patches.sweep import patch_functions

__all__ = [
    "Outcome",
    "PatchError",
    "PatchReport",
    "PatchWarning",
    "Reason",
    "get_original",
    "is_object_patched",
    "patch_all",
    "patch_functions",
    "patch_report",
    "unpatch_all",
]

REGISTRY.add((*_te.PATCHES, *_trl.PATCHES, *_torchtune.PATCHES, *_pipelining.PATCHES))


def patch_all(*, strict: bool = False, **only: Any) -> PatchReport:
    """Apply every known repair that fits the installed versions; return the report.

    Keyword arguments select: ``patch_all(trl=False)`` skips an integration,
    ``patch_all(trl="always")`` applies TRL's patches on any version,
    ``patch_all(transformer_engine="harden")`` also releases the op fuser's per-op contexts,
    ``patch_all(transformer_engine_fuser=False)`` skips one patch. Unknown keys raise
    ``TypeError`` before anything changes. Call it at startup, before or after importing
    the libraries: patches wait for their module to be imported.

    Kept: the registry (``leakfree.patches.REGISTRY``) holds each applied patch's originals
    (:func:`get_original`) and a post-import hook per module a patch waits for, until
    :func:`unpatch_all`.
    """
    _args.flag("patch_all", "strict", strict)
    chosen = REGISTRY.select(only)
    REGISTRY.request(chosen, strict)
    return patch_report()


def unpatch_all() -> PatchReport:
    """Revert every applied patch (and every ``patch_functions`` sweep) to the originals,
    from the table of originals; pending patches become no-ops."""
    REGISTRY.revert_all()
    return patch_report()


def patch_report() -> PatchReport:
    """What was applied, what is waiting for an import, what was skipped and why: one
    record per patch, then one per active sweep (``sweep.<prefix>``), each with its
    :class:`Outcome`, :class:`Reason` (None where the outcome says it all) and detail."""
    return REGISTRY.report()
