"""Transformer Engine: release ``ctx.tensor_objects`` after backward.

In forward, TE strips the buffers out of its quantized storage objects (Float8 / MXFP8 /
NVFP4 / Blockwise ``*TensorStorage``, ``*TensorBase`` up to 2.8) with
``prepare_for_saving``, saves the buffers with ``save_for_backward`` and parks the emptied
objects in ``ctx.tensor_objects``. Backward's ``restore_from_saved`` puts the buffers back
into those same objects, which stay pinned by ``ctx`` until the graph dies: +20 GB with
full activation checkpointing, an OOM on Llama3 405B. Only FP8-type recipes leak.

The repair is :func:`leakfree.release_after_backward` with ``attrs=("tensor_objects",)``
(the class's original ``backward`` kept in the registry's table of originals):
the attribute is set to ``None`` after the last backward, exactly as TE 2.15's own fix
does. The table below is REFERENCE's; versions are read from package metadata, never by
importing TE (which loads CUDA libraries).
"""

from __future__ import annotations

import types
from typing import Any

import torch

from leakfree.patches._code import code_facts
from leakfree.patches._originals import Changes
from leakfree.patches._registry import Patch, Reason, Skip

__all__ = ["PATCHES"]

DISTRIBUTIONS = ("transformer_engine", "transformer-engine", "transformer_engine_torch")
ATTR = "tensor_objects"
#: Optional hardening (``patch_all(transformer_engine="harden")``): the fuser's backward
#: stops early when no more gradients are needed, leaving the per-op contexts of the ops
#: that did not run (their saved tensors, and attributes such as grouped MLP's split
#: offsets or a caller's gradient buffer) on ``func_ctx.basic_op_ctxs``. No release of TE
#: clears that list, 2.14+ included, so the hardening applies there too.
FUSER_EXTRA = "basic_op_ctxs"

_OLD_ATTENTION = "transformer_engine.pytorch.attention"
_NEW_BACKENDS = "transformer_engine.pytorch.attention.dot_product_attention.backends"
_NEW_CP = "transformer_engine.pytorch.attention.dot_product_attention.context_parallel"


def _helpers(target: type, module: types.ModuleType, names: set[str]) -> list[Any]:
    """Functions of ``module`` that code naming ``names`` may call: module-level functions,
    the target's own static / class methods (2.11's ``_LayerNormMLP._recompute``), and
    methods of the module's classes (2.16's ``LinearBwdArgs.setup_saved_tensors``).
    Only code defined in the module itself: the search never leaves it."""
    found: list[Any] = []
    for name in names:
        value = module.__dict__.get(name)
        if isinstance(value, types.FunctionType) and value.__module__ == module.__name__:
            found.append(value)
        raw = target.__dict__.get(name)
        if isinstance(raw, (staticmethod, classmethod)):
            found.append(raw.__func__)
    for value in list(module.__dict__.values()):
        if isinstance(value, type) and value.__module__ == module.__name__:
            for name in names & set(value.__dict__):
                raw = value.__dict__[name]
                fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
                if isinstance(fn, types.FunctionType):
                    found.append(fn)
    return found


def _backward_facts(target: type, module: types.ModuleType, fn: Any) -> tuple[set[str], set[str]]:
    """:func:`~leakfree.patches._code.code_facts` of the backward and of the module's
    helpers it reaches (TE moved the restore out of ``backward`` in several releases),
    transitively."""
    names, stored = code_facts(fn)
    seen: set[int] = {id(fn)}
    todo = _helpers(target, module, names)
    while todo:
        helper = todo.pop()
        if id(helper) in seen:
            continue
        seen.add(id(helper))
        more_names, more_stored = code_facts(helper)
        todo.extend(_helpers(target, module, more_names - names))
        names |= more_names
        stored |= more_stored
    return names, stored


def _check(target: Any, module: types.ModuleType, option: Any = True) -> Skip | None:
    if not (isinstance(target, type) and issubclass(target, torch.autograd.Function)):
        return Skip(Reason.TARGET_NOT_FOUND, f"{target!r} is not an autograd Function")
    backward = target.__dict__.get("backward")
    fn = getattr(backward, "__func__", backward)
    if fn is None:
        return Skip(Reason.TARGET_NOT_FOUND, f"{target.__qualname__} defines no backward")
    names, stored = _backward_facts(target, module, fn)
    if "restore_from_func_ctx" in names or ATTR in stored:
        if _hardens(target, option) and FUSER_EXTRA not in stored:
            # Upstream (2.14+) releases tensor_objects but never the per-op contexts that
            # an early exit of the fuser's backward skips: hardening still adds that.
            return None
        return Skip(Reason.ALREADY_FIXED, f"{target.__qualname__}.backward releases {ATTR}")
    if "restore_from_saved" not in names or ATTR not in names:
        return Skip(
            Reason.NOT_PRESENT,
            f"{target.__qualname__}.backward (and the helpers it calls) does not use "
            f"restore_from_saved / ctx.{ATTR}",
        )
    return None


def _hardens(target: Any, option: Any) -> bool:
    return option == "harden" and "Fuser" in target.__name__


def _apply(target: Any, module: types.ModuleType, option: Any, changes: Changes) -> None:
    attrs = (ATTR, FUSER_EXTRA) if _hardens(target, option) else (ATTR,)
    changes.release_after_backward(target, attrs)


def _patch(
    name: str,
    target: str,
    modules: tuple[tuple[str, str], ...],
    affected: str,
    fixed_in: str,
    **kw: Any,
) -> Patch:
    return Patch(
        name=f"transformer_engine.{name}",
        integration="transformer_engine",
        distributions=DISTRIBUTIONS,
        modules=modules,
        target=target,
        affected=affected,
        fixed_in=fixed_in,
        check=_check,
        apply=_apply,
        description=f"ctx.{ATTR} released after the last backward",
        **kw,
    )


_ATTENTION_LAYOUTS = ((">=2.3", _NEW_BACKENDS), (">=2.0,<2.3", _OLD_ATTENTION))
_CP_LAYOUTS = ((">=2.3", _NEW_CP), (">=2.0,<2.3", _OLD_ATTENTION))

PATCHES: tuple[Patch, ...] = (
    _patch(
        "fuser",
        "_OperationFuserAutogradFunction",
        ((">=2.6", "transformer_engine.pytorch.ops.fuser"),),
        ">=2.6,<2.14",
        "2.14",
        widen=(("harden", ">=2.6"),),
    ),
    _patch("fused_attention", "FusedAttnFunc", _ATTENTION_LAYOUTS, ">=2.0,<2.15", "2.15"),
    _patch("cp_attention_p2p", "AttnFuncWithCPAndKVP2P", _CP_LAYOUTS, ">=2.0,<2.15", "2.15"),
    _patch("cp_attention_a2a", "AttnFuncWithCPAndQKVOA2A", _CP_LAYOUTS, ">=2.0,<2.15", "2.15"),
    _patch(
        "grouped_linear",
        "_GroupedLinear",
        ((">=2.0", "transformer_engine.pytorch.module.grouped_linear"),),
        ">=2.0,<2.15",
        "2.15",
    ),
    _patch(
        "linear",
        "_Linear",
        ((">=2.0", "transformer_engine.pytorch.module.linear"),),
        ">=2.0,<2.1",
        "2.1",
    ),
    _patch(
        "layernorm_linear",
        "_LayerNormLinear",
        ((">=2.0", "transformer_engine.pytorch.module.layernorm_linear"),),
        ">=2.0,<2.1",
        "2.1",
    ),
    _patch(
        "layernorm_mlp",
        "_LayerNormMLP",
        ((">=2.0", "transformer_engine.pytorch.module.layernorm_mlp"),),
        ">=2.0,<2.1",
        "2.1",
    ),
)
