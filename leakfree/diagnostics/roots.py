"""Where holders hide: the user's module globals and the locals of the frames on the stack.

:func:`~leakfree.diagnostics.find_retained` walks from roots. A leak's holder is rarely one
the user thought to pass: a module-level cache (torchtitan's ``_handle_cache``), a class
attribute, the local ``output_lst`` of the function that runs the microbatches (verl). These
helpers name them as roots, ``{name: object}``:

* :func:`module_roots`: the globals of every imported module of the user's own code (not
  torch, leakfree, the standard library or installed packages), each named
  ``module.name``; imported names (a class or function defined elsewhere, a module) are
  left to their own module;
* :func:`frame_roots`: the locals of the user's and libraries' frames on the stack above a
  frame, innermost first, each named by its variable (``output_lst``);
* :func:`code_roots`: what a step function can keep between calls: the closure variables
  and globals of it and of every function of the user's it reaches, named as the code
  names them (``kept``, ``self.history``).

Nothing is kept: the mappings are built when a watcher searches, and dropped after.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Iterable, Mapping
from typing import Any

from leakfree._walk import frame_locals
from leakfree.diagnostics.sites import SKIPPED, USER, kind_of

__all__ = ["code_roots", "frame_roots", "judged_device", "module_roots", "named_roots"]

#: what is searched after the data: functions reach holders through their closures
_CODE = (types.FunctionType, types.MethodType, functools.partial)

#: frames searched above a boundary (a Trainer's stack is some 30 deep)
MAX_FRAMES = 40
#: functions followed from a step function (a guard against huge call webs)
MAX_FUNCTIONS = 256


def named_roots(owner: str, roots: Mapping[str, Any] | Iterable[Any] | None) -> dict[str, Any]:
    """A watcher's ``roots=`` argument as ``{name: object}`` (a list is named ``root0``...);
    a ``TypeError`` naming ``owner`` otherwise."""
    if roots is None:
        return {}
    if isinstance(roots, Mapping):
        named = dict(roots)
        bad = [k for k in named if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{owner}(roots=...): names must be strings, got {bad[0]!r}")
        return named
    if isinstance(roots, (str, bytes)) or not isinstance(roots, Iterable):
        raise TypeError(
            f"{owner}(roots={roots!r}): expected {{name: object}} or a list of objects "
            "to search for holders"
        )
    return {f"root{i}": r for i, r in enumerate(roots)}


def judged_device(owner: str, device: Any) -> Any:
    """A watcher's ``device=``: the accelerator if any when None, else the CPU; a
    ``ValueError`` naming ``owner`` for what is not a device."""
    import torch

    from leakfree._args import device as checked
    from leakfree._device import accelerator

    if device is None:
        return accelerator() or torch.device("cpu")
    return checked(owner, "device", device)


def module_roots() -> dict[str, Any]:
    """The globals of the user's imported modules, ``{"module.name": value}``."""
    out: dict[str, Any] = {}
    for name, module in _user_modules():
        try:
            values = list(vars(module).items())
        except TypeError:
            continue
        for var, value in values:
            if var.startswith("__") or isinstance(value, types.ModuleType):
                continue
            if (
                isinstance(value, (type, types.FunctionType))
                and getattr(value, "__module__", name) != name
            ):
                continue  # imported from elsewhere: searched there, if it is the user's
            out[f"{name}.{var}"] = value
    return out


#: the user's modules among ``sys.modules``, as of its size then: a search picks them out
#: of every loaded module (thousands with transformers) only when one was loaded or dropped
_USER_MODULES: list[Any] = [-1, ()]


def _user_modules() -> tuple[tuple[str, types.ModuleType], ...]:
    """``(name, module)`` of every loaded module of the user's own code."""
    loaded = len(sys.modules)
    if _USER_MODULES[0] != loaded:
        found = []
        for name, module in list(sys.modules.items()):
            filename = getattr(module, "__file__", None)
            if not isinstance(module, types.ModuleType) or not isinstance(filename, str):
                continue
            if kind_of(filename) == USER:
                found.append((name, module))
        _USER_MODULES[:] = [loaded, tuple(found)]
    return _USER_MODULES[1]  # type: ignore[no-any-return]


def frame_roots(frame: types.FrameType | None) -> dict[str, Any]:
    """The locals of the frames from ``frame`` outward that are not torch's, leakfree's or
    the standard library's, ``{variable: value}`` (the innermost frame wins a name)."""
    out: dict[str, Any] = {}
    code: dict[str, Any] = {}  # functions last: a list is named `kept`, not `step<closure>`
    seen = 0
    while frame is not None and seen < MAX_FRAMES:
        if kind_of(frame.f_code.co_filename) != SKIPPED:
            seen += 1
            for var, value in frame_locals(frame):
                if var in out or var in code or isinstance(value, types.ModuleType):
                    continue
                target = code if isinstance(value, _CODE) else out
                target[var] = value
        frame = frame.f_back
    out.update(code)
    return out


def code_roots(fn: Any) -> dict[str, Any]:
    """What ``fn`` can keep between calls, ``{name: value}``: the closure variables and
    globals of ``fn`` and of every function of the user's it reaches through those names,
    ``functools.partial`` and bound methods (a partial's arguments, named by the
    walker's edges, ``partial.args[0]``, and a method's ``self``). Modules,
    classes and routines are not holders; code of torch, leakfree, the standard library
    and installed packages is not followed. At most :data:`MAX_FUNCTIONS` functions."""
    from leakfree._walk import edges_of

    out: dict[str, Any] = {}
    followed: set[int] = set()
    stack: list[tuple[str, Any]] = [("", fn)]
    while stack and len(followed) < MAX_FUNCTIONS:
        prefix, code = stack.pop()
        if id(code) in followed:
            continue
        followed.add(id(code))
        if isinstance(code, types.FunctionType):
            if kind_of(code.__code__.co_filename) != USER:
                continue
            try:
                closure = inspect.getclosurevars(code)
            except (TypeError, ValueError):
                continue
            named: Iterable[tuple[str, Any]] = {**closure.nonlocals, **closure.globals}.items()
        else:  # a partial or a bound method: the walker's edges (function, args, self)
            named = (
                ("self" if edge == ".__self__" else f"{prefix or 'partial'}{edge}", v)
                for edge, v in edges_of(code)
            )
        for name, value in named:
            if isinstance(value, _CODE):
                stack.append((name, value))
            elif not (
                inspect.ismodule(value) or inspect.isroutine(value) or inspect.isclass(value)
            ):
                out.setdefault(name, value)
    return out
