"""The generic sweep: release ctx state for every autograd Function of a package.

For libraries with the same bug that nobody has listed yet: ``patch_functions("mylib")``
applies :func:`leakfree.release_after_backward` to every ``torch.autograd.Function``
subclass defined in ``mylib`` or its submodules, those already imported and those in
modules imported later. A :class:`Sweep` is a record of the registry, of the sweep kind:
the registry's post-import hooks (the ones the patches use) sweep each module under the
prefix right after it executes, and its table of originals keeps each class's original
``backward``. Classes created later at run time (in a factory function) are not seen;
call ``patch_functions`` again after creating them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Literal

import torch

from leakfree.function import HANDLE, Function, ReleaseHandle, backward_name, release_choice
from leakfree.patches._originals import Changes
from leakfree.patches._registry import REGISTRY, SweepRecord

__all__ = ["Sweep", "active_sweeps", "patch_functions", "remove_all_sweeps"]


def _subclasses(cls: type) -> Iterator[type]:
    seen: set[type] = set()
    stack: list[type] = list(cls.__subclasses__())
    while stack:
        sub = stack.pop()
        if sub not in seen:
            seen.add(sub)
            yield sub
            stack.extend(sub.__subclasses__())


class Sweep(SweepRecord):
    """One ``patch_functions(prefix)``: what it patched, and how to undo it.

    Kept, until :meth:`remove` or :func:`leakfree.unpatch_all`: the record in the registry
    (``patch_report()`` lists it as ``sweep.<prefix>``), a post-import hook for each module
    under the prefix that starts importing, and, in the registry's table of originals, each
    patched class with its original ``backward`` / ``vjp`` (so the classes stay alive).
    """

    unit = "Function classes"

    def __init__(self, prefix: str, attrs: tuple[str, ...] | Literal["all"]) -> None:
        super().__init__(prefix, "ctx state released after the last backward")
        self.attrs = attrs

    @property
    def handles(self) -> dict[type, ReleaseHandle]:
        """The classes this sweep patched and has not put back, with their handles."""
        return {row.owner: row.via for row in REGISTRY.rows_of(self) if row.via is not None}

    @property
    def classes(self) -> list[type]:
        return list(self.handles)

    def apply(self, module_names: set[str] | None, changes: Changes) -> None:
        for cls in _subclasses(torch.autograd.Function):
            mod = getattr(cls, "__module__", "") or ""
            if module_names is not None and mod not in module_names:
                continue
            if not self.covers(mod) or issubclass(cls, Function):
                continue
            if "_backward_cls" not in cls.__dict__ or backward_name(cls) is None:
                continue  # not a concrete Function, or nothing to release after
            if HANDLE in cls.__dict__:
                continue  # already released: by this sweep, a patch, another sweep, the user
            changes.release_after_backward(cls, self.attrs)

    def sweep(self, module_names: Iterable[str] | None = None) -> None:
        """Sweep again: all the modules it covers, or only ``module_names``."""
        REGISTRY.apply_sweep(self, module_names)

    def remove(self) -> None:
        """Restore every class this sweep patched and stop sweeping new modules."""
        REGISTRY.remove_sweep(self)

    def __repr__(self) -> str:
        return f"<Sweep {self.prefix!r}: {len(self.classes)} classes>"


def patch_functions(prefix: str, attrs: Iterable[str] | Literal["all"] = "all") -> Sweep:
    """Release ctx state after backward for every autograd Function under ``prefix``.

    Args:
        prefix: a top-level package or module name (``"mylib"``, ``"mylib.ops"``).
        attrs: as for :func:`leakfree.release_after_backward`: ``"all"`` releases all ctx
            state, names release only those.

    Returns a :class:`Sweep`; ``sweep.classes`` lists what was patched so far and
    ``sweep.remove()`` (or :func:`leakfree.unpatch_all`) undoes it. Opt-in: a library's
    Function may legitimately read ctx state after its backward (a second backward with
    ``retain_graph`` is fine; reading it from outside autograd is not).
    """
    if (
        not isinstance(prefix, str)
        or not prefix
        or not all(part.isidentifier() for part in prefix.split("."))
    ):
        raise ValueError(f"patch_functions(prefix={prefix!r}): expected a module name like 'mylib'")
    names = release_choice("patch_functions", attrs)
    sweep = Sweep(prefix, "all" if names is None else tuple(sorted(names)))
    REGISTRY.add_sweep(sweep)
    return sweep


def remove_all_sweeps() -> int:
    """Remove every active sweep (:meth:`Sweep.remove`); how many there were."""
    return REGISTRY.remove_sweeps()


def active_sweeps() -> list[Sweep]:
    """The sweeps in effect, oldest first."""
    return [s for s in list(REGISTRY.sweeps) if isinstance(s, Sweep)]
