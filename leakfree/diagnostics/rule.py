"""What counts as a leak: the detector's settings, declared once, with their defaults.

:class:`Rule` holds them; a context whose defaults differ names them in :data:`CONTEXTS`;
every entry point (``MemoryTracker``, ``leakfree.watch``, the trainer callbacks,
``assert_no_leak``, ``leakfree run``) builds its rule with :meth:`Rule.of`, which checks
each setting as an argument of the call the user made. Imports no torch (the CLI's help
reads the defaults).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import leakfree._args as _args

__all__ = ["CONTEXTS", "DEFAULT_FLOOR", "Rule", "whole"]

#: bytes per step of detached growth accepted without a finding, and bytes a microbatch's
#: kept graph must hold to count (:attr:`Rule.floor`, :attr:`Rule.graph_floor`)
DEFAULT_FLOOR = 64


def whole(owner: str, name: str, value: Any, least: int) -> int:
    """``value`` if it is an int (not a bool) >= ``least``; else an error that names the
    argument as ``owner(name=value)`` (both a ``TypeError`` and a ``ValueError``)."""
    return int(_args.count(owner, name, value, least))


@dataclass(frozen=True)
class Rule:
    """What counts as a leak (see the module doc). Every setting and its default is
    declared here once; a context that needs another default names it in
    :data:`CONTEXTS`, and every entry point builds its rule with :meth:`of`."""

    warmup: int = 2  #: steps not judged across steps (caches, optimizer state, compile)
    window: int = 10  #: steps per across-step verdict (the most recent ones)
    tolerance: float = 0.0  #: bytes per step accepted beyond the noise bound
    #: bytes per step of growth accepted when no autograd graph holds it (a loss history
    #: of a few scalars per step is no leak)
    floor: float = DEFAULT_FLOOR
    #: bytes a microbatch's kept graph must hold, per backward, to count (beside a
    #: fraction of what the microbatch allocates, the larger)
    graph_floor: float = DEFAULT_FLOOR
    # -- growth that stops (judged once, over the whole run, when it ends) -----------------
    #: growth reported during a run is withdrawn at its end when it stopped: the series
    #: reached its final level at some step b, and has been flat since for at least
    #: ``window`` steps, this share of the steps the growth took, and :attr:`flat_pauses`
    #: times the longest pause between two rises of the growth
    flat_share: float = 0.5
    #: a leak that grows every N steps is flat for N - 1 steps between rises: a stretch this
    #: many times the longest pause seen while it grew is needed (3: a stretch of 3N)
    flat_pauses: float = 3.0
    #: "flat" is rising at under this share of the growth's own pace over the stretch (a
    #: cache's last stragglers), and not at all (beyond noise and ``floor``) over its last
    #: ``window`` steps; the final level is taken within this share of all the growth
    flat_pace: float = 0.125

    def __post_init__(self) -> None:
        self.check("Rule")

    @classmethod
    def of(cls, owner: str, context: str | None = None, **fields: Any) -> Rule:
        """A rule of ``fields``, each checked as an argument of ``owner`` first, so an
        error names the call the user made; a field given as None takes ``context``'s
        default (:data:`CONTEXTS`), else the rule's."""
        given = {name: value for name, value in fields.items() if value is not None}
        _check_fields(owner, given)
        return cls(**{**CONTEXTS.get(context or "", {}), **given})

    @classmethod
    def default(cls, name: str, context: str | None = None) -> Any:
        """The default of field ``name`` in ``context`` (for help texts and docs)."""
        return CONTEXTS.get(context or "", {}).get(name, getattr(cls, name))

    def check(self, owner: str) -> Rule:
        """Itself, or an error naming the bad field as ``owner``'s argument."""
        _check_fields(owner, vars(self))
        return self


#: the contexts whose defaults differ from :class:`Rule`'s, by name. ``watching``: a whole
#: training loop watched as it runs (``leakfree.watch``, the trainer callbacks,
#: ``leakfree run``), whose first steps also make the optimizer's state and compile: one
#: more step of warm-up than a test's step function.
CONTEXTS: dict[str, dict[str, Any]] = {"watching": {"warmup": 3}}


def _check_fields(owner: str, fields: Mapping[str, Any]) -> None:
    """Check a :class:`Rule`'s fields, named as ``owner``'s arguments."""
    least = {"warmup": 0, "window": 4}
    for name, value in fields.items():
        if name in least:
            whole(owner, name, value, least[name])
        elif name in ("tolerance", "floor", "graph_floor", "flat_share", "flat_pauses"):
            _args.number(owner, name, value)
        elif name == "flat_pace":
            if _args.number(owner, name, value) > 1:
                raise _args.refuse(owner, name, value, "a share between 0 and 1")
        else:
            raise _args.refuse(owner, name, value, "a field of Rule (warmup, window, ...)")
