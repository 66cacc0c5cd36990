"""The generic sweep: release ctx state for every autograd Function of a package.

For libraries with the same bug that nobody has listed yet: ``patch_functions("mylib")``
applies :func:`leakfree.release_after_backward` to every ``torch.autograd.Function``
subclass defined in ``mylib`` or its submodules, those already imported and those in
modules imported later (a meta-path finder wraps their loaders and sweeps each module
right after it executes). Classes created later at run time (in a factory function) are
not seen; call ``patch_functions`` again after creating them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from leakfree.function import (
    _HANDLE,
    Function,
    ReleaseHandle,
    _backward_name,
    release_after_backward,
)

__all__ = ["Sweep", "patch_functions"]

_lock = threading.RLock()
_sweeps: list[Sweep] = []


def _subclasses(cls: type) -> Iterator[type]:
    seen: set[type] = set()
    stack: list[type] = list(cls.__subclasses__())
    while stack:
        sub = stack.pop()
        if sub not in seen:
            seen.add(sub)
            yield sub
            stack.extend(sub.__subclasses__())


class Sweep:
    """One ``patch_functions(prefix)``: what it patched, and how to undo it."""

    def __init__(self, prefix: str, attrs: tuple[str, ...] | None) -> None:
        self.prefix = prefix
        self.attrs = attrs
        self.handles: dict[type, ReleaseHandle] = {}
        self._finder: _SweepFinder | None = None

    @property
    def classes(self) -> list[type]:
        return list(self.handles)

    def covers(self, module_name: str) -> bool:
        return module_name == self.prefix or module_name.startswith(self.prefix + ".")

    def sweep(self, module_names: Iterable[str] | None = None) -> None:
        names = set(module_names) if module_names is not None else None
        with _lock:
            for cls in _subclasses(torch.autograd.Function):
                mod = getattr(cls, "__module__", "") or ""
                if names is not None and mod not in names:
                    continue
                if not self.covers(mod) or cls in self.handles or issubclass(cls, Function):
                    continue
                if "_backward_cls" not in cls.__dict__ or _backward_name(cls) is None:
                    continue  # not a concrete Function, or nothing to release after
                if _HANDLE in cls.__dict__:
                    continue  # already released by someone else (a patch, another sweep)
                self.handles[cls] = release_after_backward(cls, self.attrs)  # type: ignore[arg-type]

    def remove(self) -> None:
        """Restore every class this sweep patched and stop sweeping new modules."""
        with _lock:
            for handle in self.handles.values():
                handle.restore()
            self.handles.clear()
            if self._finder is not None and self._finder in sys.meta_path:
                sys.meta_path.remove(self._finder)
            self._finder = None
            if self in _sweeps:
                _sweeps.remove(self)

    def __repr__(self) -> str:
        return f"<Sweep {self.prefix!r}: {len(self.handles)} classes>"


class _SweepLoader(importlib.abc.Loader):
    """Delegates to the real loader; sweeps the module once it has executed."""

    def __init__(self, loader: Any, sweep: Sweep) -> None:
        self._loader = loader
        self._sweep = sweep

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        self._sweep.sweep([module.__name__])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _SweepFinder(importlib.abc.MetaPathFinder):
    def __init__(self, sweep: Sweep) -> None:
        self._sweep = sweep
        self._busy = threading.local()

    def find_spec(
        self, fullname: str, path: Any, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not self._sweep.covers(fullname) or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _SweepLoader(spec.loader, self._sweep)
                    return spec  # type: ignore[no-any-return]
            return None
        finally:
            self._busy.on = False


def patch_functions(prefix: str, attrs: Iterable[str] | None = None) -> Sweep:
    """Release ctx state after backward for every autograd Function under ``prefix``.

    Args:
        prefix: a top-level package or module name (``"mylib"``, ``"mylib.ops"``).
        attrs: as for :func:`leakfree.release_after_backward`: ``None`` releases all ctx
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
    if isinstance(attrs, str):
        raise TypeError(f"patch_functions(attrs={attrs!r}): write attrs=({attrs!r},)")
    names = tuple(attrs) if attrs is not None else None
    with _lock:
        sweep = Sweep(prefix, names)
        sweep.sweep()
        sweep._finder = _SweepFinder(sweep)
        sys.meta_path.insert(0, sweep._finder)
        _sweeps.append(sweep)
    return sweep


def remove_all_sweeps() -> int:
    with _lock:
        sweeps = list(_sweeps)
    for sweep in sweeps:
        sweep.remove()
    return len(sweeps)


def active_sweeps() -> list[Sweep]:
    with _lock:
        return list(_sweeps)
