"""TRL: replace ``trl.models.activation_offloading.OffloadActivations`` with leakfree's.

TRL's offloader keeps payloads in dictionaries owned by the context manager. Before 1.4
its ``__exit__`` never cleared the stashes (5+ GB, ~0.2 GiB per step); before 1.5 entries
of forwards whose backward never ran survived until the next step (~0.6 GiB per step with
QLoRA, ~60 tensors per micro-step with MoE). :class:`leakfree.OffloadActivations` has the
same constructor and ``update_model_params``, and the graph owns its payloads.

Two names are replaced, in the module that defines them and in every module that
imported them (``trl.models``, the trainers), and put back by ``unpatch_all()``:

* ``OffloadActivations`` -> :class:`leakfree.OffloadActivations`;
* ``get_act_offloading_ctx_manager`` -> a function with TRL's signature built on
  :func:`leakfree.offload_model`, whose head hooks are replaced on every call instead of
  piling up (TRL adds a new, unremovable pair per call, in every version to date).

Applied to versions before 1.5 by default; ``patch_all(trl="always")`` applies them to
any version.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

from torch import nn

from leakfree.patches._originals import Changes
from leakfree.patches._registry import Patch, Skip, Status

__all__ = ["PATCHES", "get_act_offloading_ctx_manager"]

MODULE = "trl.models.activation_offloading"


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


def _imported_modules(prefix: str | None = None) -> list[types.ModuleType]:
    out = []
    for module_name, module in list(sys.modules.items()):
        if module_name == "leakfree" or module_name.startswith("leakfree."):
            continue  # where the replacements themselves are defined
        if not isinstance(getattr(module, "__dict__", None), dict):
            continue  # a placeholder in sys.modules (None), not a module
        if prefix is None or module_name == prefix or module_name.startswith(prefix + "."):
            out.append(module)
    return out


def _replace_everywhere(
    original: Any, replacement: Any, name: str, changes: Changes
) -> Callable[[], None]:
    """Rebind ``name`` wherever it is bound to ``original``, each rebinding written into
    the table of originals (which puts exactly those back); return the undo of what the
    table cannot know: TRL's own modules imported since, which copied the replacement from
    the patched module. Never a user module that imported leakfree's object on purpose.
    """
    for module in _imported_modules():
        if vars(module).get(name) is original:
            changes.setattr(module, name, replacement)

    def undo_later_copies() -> None:  # runs after the table's put-back
        for module in _imported_modules("trl"):
            if vars(module).get(name) is replacement:
                vars(module)[name] = original

    return undo_later_copies


def _check_class(target: Any, module: types.ModuleType, option: Any = True) -> Skip | None:
    if not isinstance(target, type) or not hasattr(target, "update_model_params"):
        return Skip(Status.TARGET_NOT_FOUND, f"{target!r} is not TRL's OffloadActivations class")
    return None


def _check_function(target: Any, module: types.ModuleType, option: Any = True) -> Skip | None:
    if not callable(target) or getattr(target, "__code__", None) is None:
        return Skip(Status.TARGET_NOT_FOUND, f"{target!r} is not a function")
    if "model" not in target.__code__.co_varnames[: target.__code__.co_argcount]:
        return Skip(Status.TARGET_NOT_FOUND, "get_act_offloading_ctx_manager(model, ...) expected")
    return None


def _apply_class(
    target: Any, module: types.ModuleType, option: Any, changes: Changes
) -> Callable[[], None]:
    from leakfree.offload import OffloadActivations

    return _replace_everywhere(target, OffloadActivations, "OffloadActivations", changes)


def _apply_function(
    target: Any, module: types.ModuleType, option: Any, changes: Changes
) -> Callable[[], None]:
    return _replace_everywhere(
        target, get_act_offloading_ctx_manager, "get_act_offloading_ctx_manager", changes
    )


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="trl.offload_activations",
        integration="trl",
        distributions=("trl",),
        modules=(("", MODULE),),
        target="OffloadActivations",
        affected="<1.5",
        fixed_in="1.5",
        check=_check_class,
        apply=_apply_class,
        description="replaced by leakfree.OffloadActivations",
    ),
    Patch(
        name="trl.act_offloading_ctx_manager",
        integration="trl",
        distributions=("trl",),
        modules=(("", MODULE),),
        target="get_act_offloading_ctx_manager",
        affected="<1.5",
        fixed_in="1.5",
        check=_check_function,
        apply=_apply_function,
        description="replaced by one on leakfree.offload_model (hooks never stack)",
    ),
)
