"""torchtune: replace ``torchtune.training.OffloadActivations`` with leakfree's.

torchtune's offloader (0.3.1 to 0.6.1, the last release, and its unreleased main) is the
design TRL copied, with TRL's leaks and none of TRL's later fixes (read from the released
code; its class cannot be built without CUDA, see docs/patches.md for what was reproduced):

* with streams (the default), each activation brought back in backward (unless a view of
  it outlives its node) leaves a device event in ``bwd_ev_stash``, which nothing ever
  empties: it grows every step for the manager's life, and recipes keep one manager for
  the whole run;
* it has no ``__exit__`` of its own: after the ``with`` block the forward stash still holds
  the last ``max_fwd_stash_size`` offloaded activations on the device, until backward;
* only backward empties the tracker: a forward whose backward never runs keeps its host
  copies and kept tensors for the manager's life, and the next training forward fails
  torchtune's own ``assert len(self.tracker) == 0`` (under ``python -O`` they pile up);
* ``__init__`` calls ``torch.cuda.default_stream()``: without CUDA it cannot be built
  (``AssertionError: Torch not compiled with CUDA enabled`` on a CPU build of torch;
  main raises ``ValueError`` without an accelerator);
* ``get_act_offloading_ctx_manager`` (0.4.0 on) registers a new pair of un-removable hooks
  on the output head on every call.

Two names are replaced, in the module that defines them and in every module that imported
them (``torchtune.training``, user modules), and put back by ``unpatch_all()``:

* ``OffloadActivations`` -> :class:`OffloadActivations` below: :class:`leakfree.OffloadActivations`
  with torchtune's constructor. torchtune takes ``max_fwd_stash_size`` *before*
  ``min_offload_size``, leakfree (like TRL) after it, so a plain swap would silently read
  ``OffloadActivations(True, True, 5, 1024)`` as a 5-byte threshold and 1024 copies in
  flight; the adapter maps each argument by name;
* ``get_act_offloading_ctx_manager`` -> a function with torchtune's signature built on
  :func:`leakfree.offload_model`, whose head hooks are replaced on every call.

No torchtune release fixes these, so the patches apply to every version that has the
targets; ``patch_all(torchtune=False)`` leaves torchtune alone.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from typing import Any

import torch
from packaging.version import Version
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from leakfree._device import accelerator
from leakfree.offload import OffloadActivations as _LeakfreeOffloadActivations
from leakfree.patches._rebind import replacing
from leakfree.patches._registry import FailureMode, Patch, Reason, Skip

__all__ = [
    "DISTRIBUTIONS",
    "FAILURE_MODES",
    "PATCHES",
    "OffloadActivations",
    "failure_modes",
    "get_act_offloading_ctx_manager",
]

MODULE = "torchtune.training._activation_offloading"
DISTRIBUTIONS = ("torchtune",)

#: Read from the sources of 0.3.1 - 0.6.1 (the crash and the unfinished forward reproduced on
#: CPU, tests/integration/test_torchtune.py); every one is repaired by the default patch.
FAILURE_MODES: tuple[FailureMode, ...] = (
    FailureMode(
        "crash without CUDA",
        ">=0.3.1",
        None,
        "OffloadActivations() calls torch.cuda.default_stream(): AssertionError on a CPU "
        "build of torch, and no other accelerator can use it",
        spares=("cuda",),
    ),
    FailureMode(
        "event stash grows",
        ">=0.3.1",
        True,
        "bwd_ev_stash gets one device event per restored activation and is never emptied",
    ),
    FailureMode(
        "forward without backward kept",
        ">=0.3.1",
        None,
        "only backward empties the tracker: an evaluation forward keeps its host copies for "
        "the manager's life, and the next step fails torchtune's own assert",
    ),
    FailureMode(
        "head hooks stack",
        ">=0.4.0",
        None,
        "get_act_offloading_ctx_manager adds a pair of output-head hooks per call that "
        "nothing removes",
    ),
)


def failure_modes(
    version: Version, *, has_accelerator: bool | None = None, device_type: str | None = None
) -> list[tuple[FailureMode, str]]:
    """The known failure modes of torchtune ``version`` on this machine (or on one with or
    without an accelerator of type ``device_type``), each with the call that repairs it:
    always ``"patch_all()"`` (no release fixes them)."""
    if has_accelerator is None:
        device = accelerator()
        has_accelerator = device is not None
        device_type = None if device is None else device.type
    return [
        (m, "patch_all()")
        for m in FAILURE_MODES
        if m.applies(version, has_accelerator, device_type)
    ]


#: torchtune's constructor, in its order (0.3.1 to 0.6.1 and main): what the adapter maps.
TORCHTUNE_PARAMETERS = ("use_pin_memory", "use_streams", "max_fwd_stash_size", "min_offload_size")
#: leakfree's keyword-only extras, accepted by the adapter too.
LEAKFREE_EXTRAS = ("device", "force_host_copy", "pin_memory_budget")
_HELPER_PARAMETERS = ("model", "enable_activation_offloading")


class OffloadActivations(_LeakfreeOffloadActivations):
    """:class:`leakfree.OffloadActivations` with torchtune's constructor.

    Positional and keyword arguments are torchtune's, in torchtune's order
    (``use_pin_memory, use_streams, max_fwd_stash_size, min_offload_size``), each passed to
    leakfree's parameter of the same name; ``use_streams=None`` (torchtune 0.3.1 / 0.4.0:
    "streams if torch is recent enough") means streams. leakfree's keyword-only
    ``device``, ``force_host_copy`` and ``pin_memory_budget`` are accepted as well. An
    unknown keyword raises ``TypeError`` naming it, before anything is built.

    What is kept and released is leakfree's contract: the graph owns every payload, and
    ``__exit__`` leaves nothing of a step on the manager (see :mod:`leakfree.offload`).
    Without an accelerator (and without ``force_host_copy=True``) it offloads nothing:
    saved tensors stay where plain PyTorch keeps them.
    """

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool | None = True,
        max_fwd_stash_size: int = 5,
        min_offload_size: int = 1024,
        *,
        device: torch.device | str | None = None,
        force_host_copy: bool = False,
        pin_memory_budget: int | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            name = next(iter(unknown))
            raise TypeError(
                f"torchtune.training.OffloadActivations({name}={unknown[name]!r}): no such "
                f"argument; torchtune's are {', '.join(TORCHTUNE_PARAMETERS)} (in that "
                f"order), and leakfree adds the keywords {', '.join(LEAKFREE_EXTRAS)}"
            )
        super().__init__(
            use_pin_memory=use_pin_memory,
            use_streams=True if use_streams is None else use_streams,
            min_offload_size=min_offload_size,
            max_fwd_stash_size=max_fwd_stash_size,
            device=device,
            force_host_copy=force_host_copy,
            pin_memory_budget=pin_memory_budget,
        )


def _torchtune_head(model: nn.Module) -> nn.Module | None:
    """The module torchtune keeps on the device: ``model.output``, or the ``linear`` of a
    ``TiedLinear`` output (not a module itself)."""
    output = getattr(model, "output", None)
    if isinstance(output, nn.Module):
        return output
    linear = getattr(output, "linear", None)
    return linear if isinstance(linear, nn.Module) else None


def get_act_offloading_ctx_manager(
    model: nn.Module, enable_activation_offloading: bool
) -> _LeakfreeOffloadActivations | contextlib.nullcontext[None]:
    """torchtune's ``get_act_offloading_ctx_manager``, on :func:`leakfree.offload_model`.

    Same signature and contract: a null context when ``enable_activation_offloading`` is
    false; else an offloader with torchtune's defaults that keeps the output head (or a
    tied output's ``linear``) on the device, and ``NotImplementedError`` for a multimodal
    model (``decoder``, no ``output``), as torchtune raises. A model with no head found
    gets leakfree's head search, and a warning if that finds none too. The difference:
    the head hooks are kept per model, replaced by the next call and removable with
    :func:`leakfree.remove_offload_hooks` (torchtune adds a new, unremovable pair per call).
    """
    if not enable_activation_offloading:
        return contextlib.nullcontext()
    head = _torchtune_head(model)
    if head is None and not hasattr(model, "output") and hasattr(model, "decoder"):
        raise NotImplementedError(
            "get_act_offloading_ctx_manager: torchtune does not support activation offloading "
            "for multimodal models; pass enable_activation_offloading=False"
        )
    from leakfree.offload import offload_model

    return offload_model(model, head=head)


def _parameters(function: Any) -> tuple[str, ...] | None:
    """Names of ``function``'s plain (positional-or-keyword) parameters, ``self`` dropped;
    None if it has any other kind (the adapter maps plain parameters only)."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None
    if parameters and parameters[0].name == "self":
        parameters = parameters[1:]
    if any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters):
        return None
    return tuple(p.name for p in parameters)


def _check_class(target: Any, module: types.ModuleType, option: Any = True) -> Skip | None:
    if not (isinstance(target, type) and issubclass(target, saved_tensors_hooks)):
        return Skip(
            Reason.TARGET_NOT_FOUND, f"{target!r} is not torchtune's OffloadActivations class"
        )
    found = _parameters(target.__init__)
    if found != TORCHTUNE_PARAMETERS:
        return Skip(
            Reason.TARGET_NOT_FOUND,
            f"OffloadActivations.__init__ takes {found}, the adapter maps {TORCHTUNE_PARAMETERS}",
        )
    return None


def _check_function(target: Any, module: types.ModuleType, option: Any = True) -> Skip | None:
    if not inspect.isfunction(target) or _parameters(target) != _HELPER_PARAMETERS:
        return Skip(
            Reason.TARGET_NOT_FOUND,
            f"get_act_offloading_ctx_manager{_HELPER_PARAMETERS} expected, found {target!r}",
        )
    return None


# Unfixed upstream: every version with the target is affected. Versions without it (the
# class came in 0.3.1, the helper in 0.4.0) have no location, so nothing is tried there.
PATCHES: tuple[Patch, ...] = (
    Patch(
        name="torchtune.offload_activations",
        integration="torchtune",
        distributions=DISTRIBUTIONS,
        modules=((">=0.3.1", MODULE),),
        target="OffloadActivations",
        affected="",
        fixed_in="no release",
        check=_check_class,
        apply=replacing("OffloadActivations", lambda: OffloadActivations, package="torchtune"),
        description="replaced by leakfree.OffloadActivations with torchtune's argument order",
    ),
    Patch(
        name="torchtune.act_offloading_ctx_manager",
        integration="torchtune",
        distributions=DISTRIBUTIONS,
        modules=((">=0.4.0", MODULE),),
        target="get_act_offloading_ctx_manager",
        affected="",
        fixed_in="no release",
        check=_check_function,
        apply=replacing(
            "get_act_offloading_ctx_manager",
            lambda: get_act_offloading_ctx_manager,
            package="torchtune",
        ),
        description="replaced by one on leakfree.offload_model (hooks never stack)",
    ),
)
