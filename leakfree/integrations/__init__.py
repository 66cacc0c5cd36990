"""Callbacks for the trainers people already use; each one imports its framework only.

* :mod:`leakfree.integrations.transformers`: ``LeakfreeCallback`` (a
  ``transformers.TrainerCallback``) and ``LossLogMixin`` (``LossLog`` inside a ``Trainer``
  subclass);
* :mod:`leakfree.integrations.lightning`: ``LeakfreeCallback`` (a Lightning ``Callback``).

Both callbacks share one watcher (:mod:`leakfree.integrations._growth`): live bytes sampled
after every optimizer step, a growth verdict per window of steps after a warm-up, and, on
growth, a :class:`MemoryGrowthWarning` (or a :class:`~leakfree.testing.LeakError` with
``fail=True``) naming the growth and what :func:`~leakfree.diagnostics.find_retained` finds.

Importing this package imports neither transformers nor Lightning (nor torch): import the
submodule of the framework you use. Guide: docs/integrations.md.
"""

from __future__ import annotations

# The warnings are leakfree's (exported there); here they are only at hand.
from leakfree.errors import MemoryGrowthWarning as MemoryGrowthWarning
from leakfree.errors import NotJudgedWarning as NotJudgedWarning

__all__: list[str] = []
