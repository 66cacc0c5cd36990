"""leakfree: autograd object lifetimes done right.

Primitives that cannot leak accelerator memory through autograd lifetimes, patches for
libraries that still do, and diagnostics that find the next leak. Guide: docs/index.md.

The public names are loaded on first use (PEP 562), so ``import leakfree`` alone, and the
``leakfree`` command's ``--help`` / ``--version``, do not import torch.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: every name reachable here -> the module that defines it (``__all__`` lists the ones a
#: user needs; the ``TYPE_CHECKING`` block below imports every one, for type checkers:
#: tests/test_api.py holds the three together)
_EXPORTS = {
    "Function": "leakfree.function",
    "ReferenceCycleError": "leakfree.function",
    "release_after_backward": "leakfree.function",
    "released_attributes": "leakfree.function",
    "LossLog": "leakfree.losses",
    "detach_tree": "leakfree.detach",
    "NoOffload": "leakfree.offload",
    "OffloadActivations": "leakfree.offload",
    "offload_model": "leakfree.offload",
    "remove_offload_hooks": "leakfree.offload",
    "patch_all": "leakfree.patches",
    "patch_functions": "leakfree.patches",
    "patch_report": "leakfree.patches",
    "unpatch_all": "leakfree.patches",
    "LeakfreeWarning": "leakfree.errors",
    "PatchWarning": "leakfree.errors",
    "PatchError": "leakfree.errors",
    "MemoryGrowthWarning": "leakfree.errors",
    "NotJudgedWarning": "leakfree.errors",
    "watch": "leakfree.diagnostics.watch",
}
_SUBMODULES = ("pipeline",)

# What a user needs, and no more: the rest (LossList, RunningLoss, ReleaseHandle, the
# pools, the registry's records...) stays importable from the module that defines it.
# ``NoOffload``, ``remove_offload_hooks``, ``patch_functions``, ``PatchError`` and
# ``PatchWarning`` are exported by their subpackages and reach from here too
# (``leakfree.NoOffload``), without a second entry in a second ``__all__``.

__all__ = [
    "Function",
    "LeakfreeWarning",
    "LossLog",
    "MemoryGrowthWarning",
    "NotJudgedWarning",
    "OffloadActivations",
    "ReferenceCycleError",
    "detach_tree",
    "offload_model",
    "patch_all",
    "patch_report",
    "pipeline",
    "release_after_backward",
    "released_attributes",
    "unpatch_all",
    "watch",
]


if "torch" in sys.modules:
    # a checkpoint holding a LossLog then loads with torch.load's defaults, even before
    # the script touches LossLog (leakfree.losses registers its rebuild functions)
    importlib.import_module("leakfree.losses")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(f"leakfree.{name}")
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'leakfree' has no attribute {name!r}")
    globals()[name] = value  # the next lookup is a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_EXPORTS})


if TYPE_CHECKING:
    from leakfree import pipeline
    from leakfree.detach import detach_tree
    from leakfree.diagnostics.watch import watch
    from leakfree.errors import (
        LeakfreeWarning,
        MemoryGrowthWarning,
        NotJudgedWarning,
    )
    from leakfree.errors import (
        PatchError as PatchError,
    )
    from leakfree.errors import (
        PatchWarning as PatchWarning,
    )
    from leakfree.function import (
        Function,
        ReferenceCycleError,
        release_after_backward,
        released_attributes,
    )
    from leakfree.losses import LossLog
    from leakfree.offload import (
        NoOffload as NoOffload,
    )
    from leakfree.offload import (
        OffloadActivations,
        offload_model,
    )
    from leakfree.offload import (
        remove_offload_hooks as remove_offload_hooks,
    )
    from leakfree.patches import patch_all, patch_report, unpatch_all
    from leakfree.patches import patch_functions as patch_functions
