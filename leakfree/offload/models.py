"""Model helpers compatible with TRL's and torchtune's: keep the output head on the device.

:func:`offload_model` builds an :class:`OffloadActivations` for a model and runs its head
(found the way TRL finds it, or named) under :class:`NoOffload`; the forward hooks it
registers are kept in one weak table per model, so calling it again replaces them and
:func:`remove_offload_hooks` removes them.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

import leakfree._args as _args
from leakfree.offload.hooks import NoOffload, OffloadActivations
from leakfree.offload.pool import OffloadWarning

__all__ = ["offload_model", "remove_offload_hooks"]


_MODEL_HOOKS: weakref.WeakKeyDictionary[nn.Module, list[RemovableHandle]] = (
    weakref.WeakKeyDictionary()
)
_HEAD_NAMES = ("output", "lm_head", "decoder.output", "decoder.lm_head", "head")


def _find_head(model: nn.Module) -> nn.Module | None:
    root = getattr(model, "module", model)  # DDP / FSDP1 wrappers
    if hasattr(root, "base_model") and hasattr(root, "peft_config"):
        root = root.base_model
    for name in _HEAD_NAMES:
        obj: Any = root
        for part in name.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.Module):
            linear = getattr(obj, "linear", None)
            return linear if isinstance(linear, nn.Module) and name == "output" else obj
    for name in ("final_layer_norm", "ln_f"):
        obj = getattr(root, name, None)
        if isinstance(obj, nn.Module):
            return obj
    return None


def offload_model(
    model: nn.Module,
    *,
    head: nn.Module | str | None = None,
    no_offload: Iterable[nn.Module | str] = (),
    warn_if_no_head: bool = True,
    **kwargs: Any,
) -> OffloadActivations:
    """An :class:`OffloadActivations` for ``model``, with its output head kept on device.

    Registers forward hooks that run the head (found as TRL does: ``output``, ``lm_head``,
    ``decoder.output``, ``head``, ``final_layer_norm`` / ``ln_f``; or given as ``head``, a
    module or a dotted name) and the ``no_offload`` modules under :class:`NoOffload`, and
    tells the context about the model's parameters. Calling it again for the same model
    first removes the hooks of the previous call (they never stack);
    :func:`remove_offload_hooks` removes them. ``kwargs`` go to ``OffloadActivations``.
    """
    # Every argument is checked, and every module found, before the model is touched.
    _args.module("offload_model", "model", model)
    _args.flag("offload_model", "warn_if_no_head", warn_if_no_head)
    named = (nn.Module, str)
    excluded = _args.items("offload_model", "no_offload", no_offload, named, "modules or names")
    found = _find_head(model) if head is None else _resolve(model, head, "head")
    modules = [found] if found is not None else []
    modules += [_resolve(model, m, "no_offload") for m in excluded]
    ctx = OffloadActivations(**kwargs)
    ctx.update_model_params(model)
    remove_offload_hooks(model)
    if found is None and warn_if_no_head:
        warnings.warn(
            "offload_model: no output head found (output, lm_head, head, ...); its "
            "activations will be offloaded and brought back at once. Pass head=...",
            OffloadWarning,
            stacklevel=2,
        )
    handles: list[RemovableHandle] = []
    for module in modules:
        guard = NoOffload()
        handles.append(module.register_forward_pre_hook(_enter_hook(guard)))
        handles.append(module.register_forward_hook(_exit_hook(guard), always_call=True))
    _MODEL_HOOKS[model] = handles
    return ctx


def remove_offload_hooks(model: nn.Module) -> int:
    """Remove the hooks :func:`offload_model` registered on ``model``; returns how many."""
    _args.module("remove_offload_hooks", "model", model)
    handles = _MODEL_HOOKS.pop(model, [])
    for h in handles:
        h.remove()
    return len(handles)


def _resolve(model: nn.Module, m: nn.Module | str, arg: str) -> nn.Module:
    if isinstance(m, nn.Module):
        return m
    if not isinstance(m, str):
        raise _args.refuse("offload_model", arg, m, "a module of the model, or its dotted name")
    try:
        return model.get_submodule(m)
    except AttributeError:
        raise ValueError(f"offload_model({arg}={m!r}): the model has no such submodule") from None


def _enter_hook(guard: NoOffload) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        guard.__enter__()

    return hook


def _exit_hook(guard: NoOffload) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        guard.__exit__(None, None, None)

    return hook
