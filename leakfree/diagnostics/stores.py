"""Stores that fill and stop: what a growing holder is bounded by, and the parameters'
state that optimizers make lazily.

A run that ends while its memory still grows may be filling a store with a bound: a
``deque(maxlen=64)``, an ``lru_cache(maxsize=24)``, an optimizer that makes a parameter's
state at its first update (layers unfrozen one by one). :func:`bound_of` reads the bound of
a holder named by its path (``buffer``, ``load_system<cache>``, ``trainer.history``), and
:class:`ParameterState` counts the bytes of the optimizers' state and of the gradients of
the parameters that have some, so the detector can tell such a ramp from a leak
(:mod:`~leakfree.diagnostics.detector`).

Kept: a :class:`ParameterState` holds its optimizers weakly, and two integers.
"""

from __future__ import annotations

import collections
import functools
import re
import weakref
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["ParameterState", "bound_of"]

#: a holder path's leading part: names and ``.attr`` / ``['key']`` / ``[3]`` steps, up to a
#: ``[*]`` or a ``<cache>``
_STEP = re.compile(r"\.?([A-Za-z_]\w*)|\[('[^']*'|\d+)\]")
_LRU = getattr(functools, "_lru_cache_wrapper", None)


def bound_of(where: str, roots: Mapping[str, Any]) -> str | None:
    """The bound of the store a holder's path ends at (``deque(maxlen=64), 64 held``), or
    None when it has none, or when the path cannot be followed from ``roots`` (``{name:
    object}``; a name also matches a root named ``module.name``)."""
    cache = where.endswith("<cache>")
    path = where[: -len("<cache>")] if cache else where
    obj = _follow(path, roots)
    if obj is None:
        return None
    if cache and _LRU is not None and isinstance(obj, _LRU):
        info = obj.cache_info()
        if info.maxsize is not None:
            return f"lru_cache(maxsize={info.maxsize}), {info.currsize} held"
        return None
    if not cache and isinstance(obj, collections.deque) and obj.maxlen is not None:
        return f"deque(maxlen={obj.maxlen}), {len(obj)} held"
    return None


def _follow(path: str, roots: Mapping[str, Any]) -> Any:
    steps = []
    at = 0
    while at < len(path):
        step = _STEP.match(path, at)
        if step is None or step.end() == at:
            return None  # a ``[*]`` or a form not followed: no single object
        steps.append(step)
        at = step.end()
    if not steps or steps[0][1] is None:
        return None
    first = steps[0][1]
    obj = roots.get(first)
    if obj is None:
        obj = next((v for k, v in roots.items() if k.endswith("." + first)), None)
    for step in steps[1:]:
        if obj is None:
            return None
        try:
            if step[1] is not None:
                obj = getattr(obj, step[1])
            else:
                key = step[2]
                obj = obj[key[1:-1]] if key.startswith("'") else obj[int(key)]
        except (AttributeError, KeyError, IndexError, TypeError):
            return None
    return obj


class ParameterState:
    """The bytes the optimizers seen hold for their parameters (their state) and those
    parameters' gradients: what grows, and stops, as an optimizer makes state lazily.
    Counted again only when the number of parameters with state changed."""

    def __init__(self) -> None:
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._entries = -1
        self._bytes = 0

    def seen(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizers.add(optimizer)

    def bytes(self) -> int:
        """The bytes now (cheap while no parameter gained state since the last call)."""
        optimizers = list(self._optimizers)
        entries = sum(len(o.state) for o in optimizers)
        if entries != self._entries:
            self._entries = entries
            self._bytes = sum(_state_bytes(o) for o in optimizers)
        return self._bytes


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for param, state in list(optimizer.state.items()):
        values = list(state.values()) if isinstance(state, dict) else []
        if isinstance(param, torch.Tensor) and param.grad is not None:
            values.append(param.grad)
        for value in values:
            if isinstance(value, torch.Tensor):
                total += value.untyped_storage().nbytes()
    return total
