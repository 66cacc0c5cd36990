"""The warning categories leakfree issues (filter them with ``warnings.filterwarnings``)."""

from __future__ import annotations

__all__ = ["LeakfreeWarning", "PatchWarning"]


class LeakfreeWarning(UserWarning):
    """Base class of every warning leakfree issues."""


class PatchWarning(LeakfreeWarning):
    """A patch could not find the code it expects and did nothing (``patch_all``)."""
