"""The warning categories leakfree issues (filter them with ``warnings.filterwarnings``)."""

from __future__ import annotations

__all__ = ["LeakfreeWarning", "MemoryGrowthWarning", "PatchWarning"]


class LeakfreeWarning(UserWarning):
    """Base class of every warning leakfree issues."""


class PatchWarning(LeakfreeWarning):
    """A patch could not find the code it expects and did nothing (``patch_all``)."""


class MemoryGrowthWarning(LeakfreeWarning):
    """Live memory grew per optimizer step after the warm-up (an integration callback's
    verdict, :mod:`leakfree.integrations`). Turn it into an error with
    ``warnings.filterwarnings("error", category=...)`` or the callback's ``fail=True``."""
