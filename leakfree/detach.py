"""``detach_tree``: every tensor inside a nested structure, detached, the structure rebuilt.

For outputs handed to logging or kept for later (metrics dicts, model outputs, dataclasses):
what comes back shares storage with what went in but carries no ``grad_fn``, so holding it
never keeps a graph alive. :class:`leakfree.LossLog` detaches its own entries; this is for
everything else.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import types
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

__all__ = ["detach_tree"]

T = TypeVar("T")


def detach_tree(obj: T) -> T:
    """Return ``obj`` with every tensor inside it detached, for outputs handed to logging.

    Walks mappings, sequences, sets and dataclass instances and rebuilds each container
    with its own type and its own extra state: ``dict`` and its subclasses
    (``OrderedDict``, ``defaultdict`` with its ``default_factory``, ``Counter``...),
    ``ChainMap`` (each of its maps), ``MappingProxyType``, lists and list subclasses,
    tuples and named tuples, ``deque`` (with its ``maxlen``), sets, frozensets and
    dataclasses. Anything else is returned as is. A container it cannot rebuild (a custom
    ``Mapping`` that is not a ``dict``) raises ``TypeError`` naming its type, rather than
    coming back as something else. The detached tensors share storage with the originals
    (no copy), but carry no ``grad_fn``: holding them never keeps a graph alive.
    """
    return _detach(obj, {})  # type: ignore[no-any-return]


def _detach(obj: Any, memo: dict[int, Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, (str, bytes, int, float, type(None))):
        return obj
    key = id(obj)
    if key in memo:
        return memo[key]
    result: Any
    if isinstance(obj, dict):
        # A shallow copy keeps the subclass and its state (default_factory...), then the
        # values are replaced in place; keys are hashable and stay as they are.
        result = dict(obj) if type(obj) is dict else copy.copy(obj)
        memo[key] = result
        for k, v in obj.items():
            result[k] = _detach(v, memo)
        return result
    if isinstance(obj, collections.ChainMap):
        result = copy.copy(obj)
        memo[key] = result
        result.maps = [_detach(m, memo) for m in obj.maps]
        return result
    if isinstance(obj, types.MappingProxyType):
        result = types.MappingProxyType(_detach(dict(obj), memo))
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        result = type(obj)(*(_detach(v, memo) for v in obj))
    elif isinstance(obj, collections.deque):
        result = type(obj)((_detach(v, memo) for v in obj), maxlen=obj.maxlen)
    elif isinstance(obj, list):
        result = [] if type(obj) is list else copy.copy(obj)
        memo[key] = result
        result[:] = [_detach(v, memo) for v in obj]
        return result
    elif isinstance(obj, (tuple, set, frozenset)):
        result = type(obj)(_detach(v, memo) for v in obj)
    elif isinstance(obj, Mapping):
        raise TypeError(
            f"detach_tree: cannot rebuild a {type(obj).__qualname__} (a Mapping that is not "
            "a dict); convert it first, e.g. detach_tree(dict(obj))"
        )
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: _detach(getattr(obj, f.name), memo) for f in dataclasses.fields(obj) if f.init
        }
        result = dataclasses.replace(obj, **changes)
        for f in dataclasses.fields(obj):
            if not f.init and hasattr(obj, f.name):
                object.__setattr__(result, f.name, _detach(getattr(obj, f.name), memo))
    else:
        return obj
    memo[key] = result
    return result
