"""Diagnostics: measure what a training step leaves behind, and who holds it.

* :class:`MemoryTracker` / :func:`fit_growth`: live bytes per device per step, growth per
  step with a noise bound (CUDA allocator statistics, or tracked tensor storages on any
  device);
* the detector behind both (:class:`Rule`, :class:`Finding`): memory kept per microbatch
  within a step, growth that keeps graphs whatever its size, tensors held by reference
  cycles, each with its holder and the line that created it;
* :func:`find_retained`: containers (class attributes included) holding backpropagated
  graphs, with the leaves and gradients they pin; ctx attributes kept after their backward;
  growable containers of tensors without a graph;
* :mod:`leakfree.diagnostics.oom`: the report so far at an out-of-memory error;
  :mod:`leakfree.diagnostics.cache`: a leak told from the allocator's cache and fragmentation;
* :mod:`leakfree.diagnostics.snapshot`: analysis of ``torch.cuda.memory._snapshot()`` files;
* :func:`count_host_syncs`: device-to-host synchronisations at the aten level.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Loaded on first use (PEP 562): `leakfree snapshot` reads pickles without importing torch.
_EXPORTS = {
    "Finding": "leakfree.diagnostics.detector",
    "Rule": "leakfree.diagnostics.detector",
    "Growth": "leakfree.diagnostics.growth",
    "MemoryTracker": "leakfree.diagnostics.memory",
    "StorageTracker": "leakfree.diagnostics.memory",
    "fit_growth": "leakfree.diagnostics.growth",
    "RetentionReport": "leakfree.diagnostics.retention",
    "find_retained": "leakfree.diagnostics.retention",
    "count_host_syncs": "leakfree.diagnostics.syncs",
}

__all__ = [
    "Finding",
    "Growth",
    "MemoryTracker",
    "RetentionReport",
    "Rule",
    "count_host_syncs",
    "find_retained",
    "fit_growth",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'leakfree.diagnostics' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # the next lookup is a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:
    from leakfree.diagnostics.detector import Finding, Rule
    from leakfree.diagnostics.growth import Growth, fit_growth
    from leakfree.diagnostics.memory import MemoryTracker
    from leakfree.diagnostics.memory import StorageTracker as StorageTracker
    from leakfree.diagnostics.retention import RetentionReport, find_retained
    from leakfree.diagnostics.syncs import count_host_syncs
