"""Rebind a replaced object wherever it was imported (the patches that swap a library's
class or function: TRL's and torchtune's offloaders).

Replacing ``pkg.mod.Name`` is not enough when other modules did ``from pkg.mod import
Name``: each holds its own binding. :func:`replace_everywhere` rebinds every module
binding the original, each rebinding written into the registry's table of originals (so
``unpatch_all()`` puts exactly those back), and returns the undo of what the table cannot
know: the library's modules imported after the patch, which copied the replacement.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

from leakfree.patches._originals import Changes

#: a :class:`~leakfree.patches._registry.Patch`'s ``apply``: (target, module, option,
#: changes) -> the undo the table of originals cannot do
Apply = Callable[[Any, types.ModuleType, Any, Changes], Callable[[], None]]


def imported_modules(package: str | None = None) -> list[types.ModuleType]:
    """The modules in ``sys.modules`` (those under ``package`` if given), leakfree's own
    excepted: that is where the replacements are defined."""
    out = []
    for module_name, module in list(sys.modules.items()):
        if module_name == "leakfree" or module_name.startswith("leakfree."):
            continue
        if not isinstance(getattr(module, "__dict__", None), dict):
            continue  # a placeholder in sys.modules (None), not a module
        if package is None or module_name == package or module_name.startswith(package + "."):
            out.append(module)
    return out


def replace_everywhere(
    original: Any, replacement: Any, name: str, changes: Changes, *, package: str
) -> Callable[[], None]:
    """Rebind ``name`` wherever it is bound to ``original`` (any imported module: a user
    module that imported the library's object gets the replacement too), through
    ``changes``; return the undo for ``package``'s modules imported since, which copied the
    replacement from the patched module. The undo never touches a module outside
    ``package``, so a user module that imported the replacement on purpose keeps it.
    """
    for module in imported_modules():
        if vars(module).get(name) is original:
            changes.setattr(module, name, replacement)

    def undo_later_copies() -> None:  # runs after the table's put-back
        for module in imported_modules(package):
            if vars(module).get(name) is replacement:
                vars(module)[name] = original

    return undo_later_copies


def replacing(name: str, replacement: Callable[[], Any], *, package: str) -> Apply:
    """The ``apply`` of a patch that swaps ``package``'s ``name`` for ``replacement()``
    (called at apply time, so the replacement's module loads only when a patch applies)
    wherever it is bound: :func:`replace_everywhere`."""

    def apply(target: Any, module: types.ModuleType, option: Any, changes: Changes) -> Any:
        return replace_everywhere(target, replacement(), name, changes, package=package)

    return apply
