"""Diagnostics: measure what a training step leaves behind, and who holds it.

* :class:`MemoryTracker` / :func:`fit_growth`: live bytes per device per step, growth per
  step with a noise bound (CUDA allocator statistics, or tracked tensor storages on any
  device);
* :func:`find_retained`: containers holding backpropagated graphs, and ctx attributes kept
  after their backward;
* :mod:`leakfree.diagnostics.snapshot`: analysis of ``torch.cuda.memory._snapshot()`` files;
* :func:`count_host_syncs`: device-to-host synchronisations at the aten level.
"""

from __future__ import annotations

from leakfree.diagnostics.memory import Growth, MemoryTracker, StorageTracker, fit_growth
from leakfree.diagnostics.retention import Retained, RetentionReport, find_retained
from leakfree.diagnostics.syncs import HostSyncCounter, count_host_syncs

__all__ = [
    "Growth",
    "HostSyncCounter",
    "MemoryTracker",
    "Retained",
    "RetentionReport",
    "StorageTracker",
    "count_host_syncs",
    "find_retained",
    "fit_growth",
]
