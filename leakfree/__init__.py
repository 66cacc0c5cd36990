"""leakfree: autograd object lifetimes done right.

Primitives that cannot leak accelerator memory through autograd lifetimes, patches for
libraries that still do, and diagnostics that find the next leak. See DESIGN in the docs.
"""

from __future__ import annotations

from leakfree import pipeline
from leakfree.function import (
    Function,
    ReferenceCycleError,
    ReleaseHandle,
    release_after_backward,
    released_attributes,
)
from leakfree.losses import LossList, LossLog, RunningLoss, detach_tree
from leakfree.offload import NoOffload, OffloadActivations, offload_model, remove_offload_hooks

__version__ = "0.1.0"

__all__ = [
    "Function",
    "LossList",
    "LossLog",
    "NoOffload",
    "OffloadActivations",
    "ReferenceCycleError",
    "ReleaseHandle",
    "RunningLoss",
    "__version__",
    "detach_tree",
    "offload_model",
    "pipeline",
    "release_after_backward",
    "released_attributes",
    "remove_offload_hooks",
]
