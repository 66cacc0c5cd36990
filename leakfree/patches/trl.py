"""TRL: replace ``trl.models.activation_offloading.OffloadActivations`` with leakfree's.

What goes wrong in TRL's own offloader (every 1.x read, 1.0 to 1.16; measured by
``benchmarks/trl_versions.py``, table in docs/patches.md), :data:`FAILURE_MODES`:

* **No accelerator: it cannot be built.** Its constructor asks
  ``torch.accelerator.current_accelerator().type``, which is ``None.type`` on a CPU-only
  machine: ``SFTTrainer(..., activation_offloading=True)`` raises ``AttributeError`` in
  ``__init__``, in every release.
* **Before 1.4 its stashes leak**: ``__exit__`` never clears them (5+ GB, ~0.2 GiB per
  step); **before 1.5** entries of forwards whose backward never ran survive until the
  next step (~0.6 GiB per step with QLoRA, ~60 tensors per micro-step with MoE).
* **On 1.5 and later, with an accelerator**: a forward whose backward never runs keeps
  its payloads until the next step; two ``with`` blocks then one backward, and a second
  ``backward(retain_graph=True)``, raise ``ValueError: Untracked tensor``.
* **Head hooks stack**: ``get_act_offloading_ctx_manager`` adds a pair of hooks to the
  output head on every call, which nothing removes (each trainer built on one model adds
  a pair), in every release.

:class:`leakfree.OffloadActivations` has the same constructor and
``update_model_params``, the graph owns its payloads, and without an accelerator it
offloads nothing (losses identical). Two names are replaced, in the module that defines
them and in every module that imported them (``trl.models``, the trainers), and put back
by ``unpatch_all()``:

* ``OffloadActivations`` -> :class:`leakfree.OffloadActivations`;
* ``get_act_offloading_ctx_manager`` -> a function with TRL's signature built on
  :func:`leakfree.offload_model`, whose head hooks are replaced on every call instead of
  piling up.

``patch_all()`` applies them where TRL's class fails: versions before 1.5 (the leak), and
any 1.x whose constructor reads ``current_accelerator()`` on a machine without an
accelerator (the crash); the report says which. ``patch_all(trl="always")`` applies them
on any version and machine (the head hooks).
"""

from __future__ import annotations

import types
from typing import Any

from packaging.version import Version
from torch import nn

from leakfree._device import accelerator
from leakfree.patches._rebind import replacing
from leakfree.patches._registry import (
    Applies,
    FailureMode,
    Patch,
    Reason,
    Skip,
    get_original,
    installed_version,
    version_matches,
)

__all__ = [
    "FAILURE_MODES",
    "PATCHES",
    "FailureMode",
    "expect",
    "failure_modes",
    "get_act_offloading_ctx_manager",
]

MODULE = "trl.models.activation_offloading"
DISTRIBUTIONS = ("trl",)
#: the versions whose stashes leak (fixed in 1.5): patched on any machine
LEAKY = "<1.5"
#: the versions the patch knows (every 1.x read): beyond them, only ``trl="always"``
KNOWN = "<2"
#: what the 1.x constructors call to learn the device type (``None.type`` without one)
PROBE = "current_accelerator"
DEFAULT = "patch_all()"
ALWAYS = "patch_all(trl='always')"


#: In the order a user meets them. Measured on CPU (the crash, in benchmarks/trl_versions.py);
#: the accelerator-only ones are read from TRL's sources and issues (docs/offload.md).
FAILURE_MODES: tuple[FailureMode, ...] = (
    FailureMode(
        "crash without an accelerator",
        ">=1.0,<2",
        False,
        "OffloadActivations() raises AttributeError ('NoneType' object has no attribute "
        "'type'): SFTTrainer(activation_offloading=True) fails in __init__",
    ),
    FailureMode(
        "torch.cuda streams",
        "<1.16",
        True,
        "the constructor takes its streams from torch.cuda on any accelerator but XPU and "
        "NPU: it raises on the others (MPS, out-of-tree devices)",
        spares=("cuda", "xpu", "npu"),
    ),
    FailureMode(
        "stashes never cleared",
        "<1.4",
        True,
        "__exit__ never clears the forward/backward stashes: every step's payloads stay",
    ),
    FailureMode(
        "unfinished forwards kept",
        "<1.5",
        True,
        "entries of forwards whose backward never ran stay for good (~0.6 GiB per step with QLoRA)",
    ),
    FailureMode(
        "stale dedup keys",
        "<1.8",
        True,
        "a reused address matches a stale storage key: offloading silently stops",
    ),
    FailureMode(
        "stream race",
        "<1.16",
        True,
        "compute stream cached at construction, no clone before wait_stream: corrupted "
        "targets, device-side asserts",
    ),
    FailureMode(
        "forward without backward kept",
        ">=1.5",
        True,
        "a forward whose backward never runs keeps its payloads until the next __enter__",
    ),
    FailureMode(
        "two with blocks, one backward",
        ">=1.5",
        True,
        "the second __enter__ wipes the first graph's entries: ValueError: Untracked tensor",
    ),
    FailureMode(
        "retain_graph twice",
        "",
        True,
        "unpack deletes the entry: the second backward(retain_graph=True) raises "
        "ValueError: Untracked tensor",
    ),
    FailureMode(
        "head hooks stack",
        "",
        True,
        "get_act_offloading_ctx_manager adds a pair of output-head hooks per call that "
        "nothing removes (one more pair per trainer built on the model)",
    ),
)


def expect(
    version: Version,
    option: Any = True,
    *,
    has_accelerator: bool | None = None,
    reads_accelerator: bool = True,
) -> Skip | Applies:
    """Whether the TRL patches apply to ``version`` on this machine, and why: the one
    decision, shared by the code check (after import, which also tells whether TRL's
    constructor reads ``current_accelerator()``: ``reads_accelerator``) and the doctor
    (before import)."""
    if has_accelerator is None:
        has_accelerator = accelerator() is not None
    known = version_matches(version, KNOWN)
    if version_matches(version, LEAKY):
        return Applies(f"TRL {version} keeps offloaded payloads past the step (fixed in 1.5)")
    if known and not has_accelerator and reads_accelerator:
        return Applies(
            f"TRL {version}'s OffloadActivations raises AttributeError without an accelerator"
        )
    if option == "always":
        return Applies(ALWAYS)
    if not known:
        return Skip(Reason.NOT_PRESENT, f"TRL {version} is newer than the releases leakfree read")
    if not has_accelerator:
        return Skip(
            Reason.NOT_PRESENT,
            f"TRL {version}'s OffloadActivations does not call {PROBE}() in __init__",
        )
    return Skip(
        Reason.ALREADY_FIXED,
        f"TRL {version} clears its stashes (1.5) and runs on this machine's accelerator",
    )


def failure_modes(
    version: Version, *, has_accelerator: bool | None = None, device_type: str | None = None
) -> list[tuple[FailureMode, str]]:
    """The known failure modes of TRL ``version`` on this machine (or on one with or
    without an accelerator, of type ``device_type`` if known), each with the
    ``patch_all`` call that repairs it: ``"patch_all()"`` where the default applies the
    patches (:func:`expect`), else ``"patch_all(trl='always')"``."""
    if has_accelerator is None:
        device = accelerator()
        has_accelerator = device is not None
        device_type = None if device is None else device.type
    default = expect(version, True, has_accelerator=has_accelerator)
    fix = DEFAULT if isinstance(default, Applies) else ALWAYS
    return [(m, fix) for m in FAILURE_MODES if m.applies(version, has_accelerator, device_type)]


def get_act_offloading_ctx_manager(
    model: nn.Module,
    use_pin_memory: bool = True,
    use_streams: bool = True,
    min_offload_size: int = 1024,
    max_fwd_stash_size: int = 5,
    warn_if_no_head: bool = True,
) -> Any:
    """TRL's ``get_act_offloading_ctx_manager``, on :func:`leakfree.offload_model`.

    Same signature and behaviour (output head and Liger modules kept on device), except
    that the hooks are registered once per model and can be removed with
    :func:`leakfree.remove_offload_hooks`.
    """
    from leakfree.offload import offload_model

    root = getattr(model, "module", model)
    liger = [m for name, m in root.named_modules() if "liger" in name.lower()]
    return offload_model(
        model,
        no_offload=liger,
        warn_if_no_head=warn_if_no_head,
        use_pin_memory=use_pin_memory,
        use_streams=use_streams,
        min_offload_size=min_offload_size,
        max_fwd_stash_size=max_fwd_stash_size,
    )


def _decide(module: types.ModuleType, option: Any) -> Skip | Applies:
    """:func:`expect`, with the crash read from the code: whether TRL's own class (the
    original, where the other patch already replaced it) calls ``current_accelerator()``
    in its constructor."""
    version = installed_version(DISTRIBUTIONS)
    if version is None:  # metadata gone since the version gate read it
        return Skip(Reason.TARGET_NOT_FOUND, "trl's version is no longer readable")
    trl_class = get_original(module, "OffloadActivations")
    init = getattr(getattr(trl_class, "__init__", None), "__code__", None)
    reads = init is not None and PROBE in init.co_names
    return expect(version, option, reads_accelerator=reads)


def _check_class(target: Any, module: types.ModuleType, option: Any = True) -> Skip | Applies:
    if not isinstance(target, type) or not hasattr(target, "update_model_params"):
        return Skip(Reason.TARGET_NOT_FOUND, f"{target!r} is not TRL's OffloadActivations class")
    return _decide(module, option)


def _check_function(target: Any, module: types.ModuleType, option: Any = True) -> Skip | Applies:
    if not callable(target) or getattr(target, "__code__", None) is None:
        return Skip(Reason.TARGET_NOT_FOUND, f"{target!r} is not a function")
    if "model" not in target.__code__.co_varnames[: target.__code__.co_argcount]:
        return Skip(Reason.TARGET_NOT_FOUND, "get_act_offloading_ctx_manager(model, ...) expected")
    return _decide(module, option)


def _offload_class() -> type:
    from leakfree.offload import OffloadActivations

    return OffloadActivations


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="trl.offload_activations",
        integration="trl",
        distributions=DISTRIBUTIONS,
        modules=(("", MODULE),),
        target="OffloadActivations",
        affected=KNOWN,
        fixed_in="1.5 for the leak; TRL 2 not read yet: trl='always'",
        check=_check_class,
        apply=replacing("OffloadActivations", _offload_class, package="trl"),
        description="replaced by leakfree.OffloadActivations",
        expect=expect,
    ),
    Patch(
        name="trl.act_offloading_ctx_manager",
        integration="trl",
        distributions=DISTRIBUTIONS,
        modules=(("", MODULE),),
        target="get_act_offloading_ctx_manager",
        affected=KNOWN,
        fixed_in="1.5 for the leak; TRL 2 not read yet: trl='always'",
        check=_check_function,
        apply=replacing(
            "get_act_offloading_ctx_manager", lambda: get_act_offloading_ctx_manager, package="trl"
        ),
        description="replaced by one on leakfree.offload_model (hooks never stack)",
        expect=expect,
    ),
)
