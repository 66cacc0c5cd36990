"""leakfree: autograd object lifetimes done right.

Primitives that cannot leak accelerator memory through autograd lifetimes, patches for
libraries that still do, and diagnostics that find the next leak. Guide: docs/index.md.
"""

from __future__ import annotations

from leakfree import pipeline
from leakfree._warnings import LeakfreeWarning, PatchWarning
from leakfree.function import (
    Function,
    ReferenceCycleError,
    ReleaseHandle,
    release_after_backward,
    released_attributes,
)
from leakfree.losses import LossList, LossLog, RunningLoss, detach_tree
from leakfree.offload import NoOffload, OffloadActivations, offload_model, remove_offload_hooks
from leakfree.patches import patch_all, patch_functions, patch_report, unpatch_all

__version__ = "0.1.0"

__all__ = [
    "Function",
    "LeakfreeWarning",
    "LossList",
    "LossLog",
    "NoOffload",
    "OffloadActivations",
    "PatchWarning",
    "ReferenceCycleError",
    "ReleaseHandle",
    "RunningLoss",
    "__version__",
    "detach_tree",
    "offload_model",
    "patch_all",
    "patch_functions",
    "patch_report",
    "pipeline",
    "release_after_backward",
    "released_attributes",
    "remove_offload_hooks",
    "unpatch_all",
]
