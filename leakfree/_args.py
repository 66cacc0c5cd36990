"""The checks of public arguments: each refuses a bad value before anything is stored,
with a message that names the call, the argument and what it expects.

The error is :class:`ArgumentError`, both a ``TypeError`` and a ``ValueError`` (as
numpy's ``AxisError`` is both a ``ValueError`` and an ``IndexError``): whichever a caller
catches, for a value of the wrong type or one out of range, catches it.

``call`` names the call as the user wrote it (``"OffloadActivations"``, ``"watch"``);
``name`` the argument, or None for an attribute set later (``call`` is then
``"OffloadActivations.device_budget"``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn


class ArgumentError(TypeError, ValueError):
    """A public argument leakfree refuses, raised before any state changes."""


def _label(call: str, name: str | None, value: object) -> str:
    return f"{call}({name}={value!r})" if name is not None else f"{call} = {value!r}"


def refuse(call: str, name: str | None, value: object, expected: str) -> ArgumentError:
    """The error for ``value``: ``call(name=value): expected ...``."""
    return ArgumentError(f"{_label(call, name, value)}: expected {expected}")


def flag(call: str, name: str | None, value: object) -> bool:
    """``value``, a bool (``1`` or ``"yes"`` are refused: a typo would pass for True)."""
    if not isinstance(value, bool):
        raise refuse(call, name, value, "True or False")
    return value


def count(
    call: str,
    name: str | None,
    value: object,
    least: int = 0,
    *,
    none: bool = False,
    unit: str = "",
) -> Any:
    """``value``, an int (not a bool) >= ``least``, or None where ``none`` allows it."""
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        what = f"an int >= {least}{f' ({unit})' if unit else ''}"
        raise refuse(call, name, value, f"None or {what}" if none else what)
    return value


def number(call: str, name: str | None, value: object, least: float = 0.0) -> float:
    """``value``, a finite int or float (not a bool) >= ``least``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < least
    ):
        raise refuse(call, name, value, f"a finite number >= {least:g}")
    return value


def module(call: str, name: str | None, value: object) -> nn.Module:
    """``value``, a ``torch.nn.Module``."""
    from torch import nn  # here: the scanner checks its arguments without importing torch

    if not isinstance(value, nn.Module):
        raise refuse(call, name, value, f"a torch.nn.Module, not {type(value).__name__}")
    return value


def function(call: str, name: str | None, value: object, *, none: bool = False) -> Any:
    """``value``, a callable, or None where ``none`` allows it."""
    if (value is None and none) or callable(value):
        return value
    raise refuse(call, name, value, "None or a callable" if none else "a callable")


def text(call: str, name: str | None, value: object, *, none: bool = False) -> Any:
    """``value``, a str, or None where ``none`` allows it."""
    if (value is None and none) or isinstance(value, str):
        return value
    raise refuse(call, name, value, "None or a str" if none else "a str")


def items(
    call: str,
    name: str | None,
    value: object,
    kinds: tuple[type, ...] = (object,),
    expected: str = "values",
) -> list[Any]:
    """``value``'s items as a list: an iterable (not a str, bytes or mapping, whose items
    are rarely what was meant), each an instance of one of ``kinds``."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise refuse(call, name, value, f"an iterable of {expected}")
    out = list(value)
    for item in out:
        if not isinstance(item, kinds):
            raise refuse(call, name, value, f"an iterable of {expected}; got {item!r}")
    return out


def seconds(call: str, name: str | None, value: object, *, none: bool = False) -> Any:
    """``value``, a finite number of seconds > 0 (not a bool), or None where ``none``
    allows it."""
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise refuse(call, name, value, "None or seconds > 0" if none else "seconds > 0")
    return value


def device(call: str, name: str | None, value: object) -> torch.device:
    """``value`` as a ``torch.device`` (a device or its name)."""
    import torch  # here: the scanner checks its arguments without importing torch

    try:
        return torch.device(value)  # type: ignore[call-overload, no-any-return]
    except (RuntimeError, TypeError) as e:
        raise ArgumentError(f"{_label(call, name, value)}: not a device ({e})") from None
