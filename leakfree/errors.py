"""What leakfree raises and warns: the warning categories (filter them with
``warnings.filterwarnings``), :class:`PatchError` and :class:`LeakError`. Imports no torch:
the finders, the integrations and the patches all import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from leakfree.diagnostics.growth import Growth


class LeakfreeWarning(UserWarning):
    """Base class of every warning leakfree issues."""


class PatchWarning(LeakfreeWarning):
    """A patch could not find the code it expects and did nothing (``patch_all``)."""


class PatchError(RuntimeError):
    """A patch requested with ``patch_all(strict=True)`` could not be applied.

    ``patch`` names it, ``reason`` says what was found, and the message says what to do.
    Raised only for the patches of the strict request: a later, non-strict
    ``patch_all()`` does not change that, nor make earlier strict requests lenient."""

    def __init__(self, patch: str, reason: str) -> None:
        self.patch = patch
        self.reason = reason
        super().__init__(
            f"leakfree patch {patch} could not be applied: {reason}. Check the installed "
            f"version against patch_report()['{patch}'] (docs/patches.md lists what each "
            f"patch expects), skip it with patch_all({patch.split('.')[0]}=False), or call "
            "patch_all() without strict=True to warn and go on"
        )


class OffloadWarning(LeakfreeWarning):
    """Something about offloading that costs speed or memory, never correctness
    (``leakfree.offload.OffloadWarning``)."""


class MemoryGrowthWarning(LeakfreeWarning):
    """Live memory grew per optimizer step after the warm-up (an integration callback's
    verdict, :mod:`leakfree.integrations`). Turn it into an error with
    ``warnings.filterwarnings("error", category=...)`` or the callback's ``fail=True``."""


class NotJudgedWarning(LeakfreeWarning):
    """A watched training ended before the detector could judge it: fewer steps after the
    warm-up than a verdict needs (or growth suspected and not yet confirmed). No leak was
    found in them, and none is ruled out: it is not a clean run."""


class LeakError(AssertionError):
    """A leak was found where failing was asked for (``assert_no_leak``, a callback's
    ``fail=True``): the message names the holders; ``growth`` is the growth per step,
    ``retained`` the retention report of the holders."""

    def __init__(self, message: str, growth: Growth, retained: Any) -> None:
        super().__init__(message)
        self.growth = growth
        self.retained = retained
