"""Diagnostics: measure what a training step leaves behind, and who holds it."""

from __future__ import annotations

from leakfree.diagnostics.syncs import HostSyncCounter, count_host_syncs

__all__ = ["HostSyncCounter", "count_host_syncs"]
