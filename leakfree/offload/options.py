"""What a user asked an :class:`~leakfree.offload.OffloadActivations` to decide by: the
options that choose what stays on the device, checked once, and the :class:`Mode` they make.

A manager is in exactly one mode, decided here once and reported by ``ctx.plan``:

* :attr:`Mode.AUTO`: the automatic budget (``device_budget="auto"``, the default): twice
  the largest copy stays, and the smallest storages stay (``keep_small``);
* :attr:`Mode.BUDGET`: an explicit ``device_budget`` in bytes;
* :attr:`Mode.OVERHEAD`: a time goal, ``max_overhead``;
* :attr:`Mode.LIMIT`: a memory goal, ``device_limit`` (with ``max_overhead`` too, that
  chooses among the plans under the limit).

Which options combine is written once, in :meth:`Options.checked`, with one message per
rule, for the constructor and for every setter alike. Plain data: nothing here holds a
tensor or imports torch.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

import leakfree._args as _args

__all__ = ["AUTO", "Mode", "Options"]

#: ``device_budget``'s automatic value (None means the same)
AUTO = "auto"


class Mode(enum.Enum):
    """How a manager decides what stays on the device (see the module doc)."""

    AUTO = "auto"
    BUDGET = "device_budget"
    OVERHEAD = "max_overhead"
    LIMIT = "device_limit"

    @property
    def goal(self) -> bool:
        """Whether the plan is chosen for a goal, from a measured step."""
        return self in (Mode.OVERHEAD, Mode.LIMIT)

    def __str__(self) -> str:
        return self.value


#: the options some modes decide for themselves: option -> (what it does, the modes that
#: honour it, said as the message says it)
_HONOURED = {
    "keep_small": ("keeps the smallest storages", (Mode.AUTO,), "the automatic budget"),
    "max_fwd_stash_size": (
        "bounds the copies in flight that hold their device tensors",
        (Mode.AUTO, Mode.BUDGET),
        "a budget (a goal's plan sizes that window)",
    ),
}


@dataclass(frozen=True)
class Options:
    """The options that decide what stays on the device, as given (None: not given), and
    the :class:`Mode` they make. Build with :meth:`checked`; change with :meth:`with_`.

    ``device_budget``: bytes of saved activations to keep on the device (None: the
    automatic budget, twice the largest copy, what prefetch would bring back at once
    anyway, with ``keep_small`` and the in-flight window; 0: move every one). The ones
    backward needs first (the last saved) stay, within the budget; the earlier ones
    move. The first forward holds its saved tensors and moves the oldest whenever the
    budget is exceeded, and leaves a plan that the next forwards of the same shapes
    follow (moving as they go); a forward of other shapes makes a new plan.

    ``keep_small`` (the automatic budget only; None: True): from the second forward on
    (the first makes the plan), the smallest saved storages stay on the device, as long
    as together they are at most 1/64 of what a forward saves (per-row statistics of
    norms, for instance): each would cost a handle, a host copy, its share of a transfer
    each way and a view in backward, and its bytes would save next to nothing. A saved
    view is weighed by its storage (a small view of a large storage moves). A forward of
    other shapes keeps at most as many small bytes as the plan did: what does not fit
    moves, and a new plan follows.

    ``max_fwd_stash_size`` (a budget, automatic or not; None: 5): how many device-to-host
    copies may be in flight at once after their group is sent, their device tensors kept
    alive until then, as TRL's; beyond it the compute stream waits for the oldest copy
    before its tensor goes (see :class:`~leakfree.offload.transfers.Transfers`). (A group
    not sent yet holds its copies' tensors too: at most ``batch_bytes``.) A goal's plan
    sizes that window in bytes itself.

    ``max_overhead``: a time goal: the step time offloading may add, a fraction of the
    step's compute (0.05: 5%). The first step of each shape is measured keeping
    everything on the device; the plan then moves the most bytes whose copies hide
    behind compute within it (:mod:`leakfree.offload.plan`).

    ``device_limit``: a memory goal: bytes the step may hold on the device (parameters
    included). The first step of each shape is measured moving everything; the plan then
    moves the fewest bytes, costing the least time, that keep the step under it (nothing
    when it fits), and the next step checks it. With ``max_overhead`` too, the plan is
    the one of those under the limit that moves the most within the time goal.

    ``batch_bytes`` (default 256 KiB): copies out smaller than this share a host block
    with the ones of their dtype saved just before and after them, up to this many
    bytes, and come back to the device with them in one transfer (one device
    allocation, one prefetch): small copies cost more in fixed overhead than in bytes. A
    copy this large or larger goes alone; 0 sends every copy alone. A group is on the
    device until it is sent and again in backward from its first use to its last, so a
    group also holds at most an eighth of what the previous forward moved (the first
    forward sends every copy alone): grouping adds at most about that to the device
    peak."""

    device_budget: int | None = None  #: None: the automatic budget
    keep_small: bool | None = None
    max_fwd_stash_size: int | None = None
    max_overhead: float | None = None
    device_limit: int | None = None
    batch_bytes: int = 256 << 10
    mode: Mode = Mode.AUTO

    @classmethod
    def checked(cls, call: str, name: str | None = None, **given: Any) -> Options:
        """The options ``given`` (by name), each checked, then how they combine; raised
        before anything is stored. ``call`` names the call for the messages:
        ``"OffloadActivations"`` for the constructor, each argument by its own name; for a
        setter ``"OffloadActivations.<name>"``, with ``name`` the option it sets."""
        values: dict[str, Any] = {}
        for option, value in given.items():
            values[option] = _CHECKS[option](call, option if name is None else None, value)
        options = cls(**values)
        mode = _mode(options)
        _combine(call, options, mode, setter=name)
        return dataclasses.replace(options, mode=mode)

    def with_(self, option: str, value: Any) -> Options:
        """These options with ``option`` set to ``value``, checked as the setter
        ``OffloadActivations.<option> = value`` (refused before anything changes)."""
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del given["mode"]
        given[option] = value
        return Options.checked(f"OffloadActivations.{option}", option, **given)

    @property
    def keeps_small(self) -> bool:
        """Whether the plan keeps the smallest storages (the automatic budget, unless
        ``keep_small=False``)."""
        return self.mode is Mode.AUTO and self.keep_small is not False

    @property
    def stash(self) -> int:
        """How many copies out may hold their device tensors in flight (a budget's window:
        5 unless given)."""
        return 5 if self.max_fwd_stash_size is None else self.max_fwd_stash_size


def _device_budget(call: str, name: str | None, value: object) -> int | None:
    if value == AUTO and isinstance(value, str):
        return None
    return _args.count(  # type: ignore[no-any-return]
        call, name, value, 0, none=True, unit='bytes of saved activations to keep, or "auto"'
    )


def _keep_small(call: str, name: str | None, value: object) -> bool | None:
    return None if value is None else _args.flag(call, name, value)


def _stash(call: str, name: str | None, value: object) -> int | None:
    return _args.count(  # type: ignore[no-any-return]
        call, name, value, 1, none=True, unit="copies in flight"
    )


def _max_overhead(call: str, name: str | None, value: object) -> float | None:
    return None if value is None else _args.number(call, name, value, 0.0)


def _device_limit(call: str, name: str | None, value: object) -> int | None:
    return _args.count(  # type: ignore[no-any-return]
        call, name, value, 0, none=True, unit="bytes the step may hold on the device"
    )


def _batch_bytes(call: str, name: str | None, value: object) -> int:
    return _args.count(  # type: ignore[no-any-return]
        call, name, value, 0, unit="bytes; 0: every copy alone"
    )


_CHECKS = {
    "device_budget": _device_budget,
    "keep_small": _keep_small,
    "max_fwd_stash_size": _stash,
    "max_overhead": _max_overhead,
    "device_limit": _device_limit,
    "batch_bytes": _batch_bytes,
}


def _mode(options: Options) -> Mode:
    if options.device_limit is not None:
        return Mode.LIMIT
    if options.max_overhead is not None:
        return Mode.OVERHEAD
    return Mode.AUTO if options.device_budget is None else Mode.BUDGET


def _combine(call: str, options: Options, mode: Mode, *, setter: str | None) -> None:
    """The rules of which options go together, each with its one message (``setter``: the
    option a setter is changing, None in the constructor)."""
    if options.device_budget is not None and mode.goal:
        goal = "device_limit" if options.device_limit is not None else "max_overhead"
        pair = {"device_budget": options.device_budget, goal: getattr(options, goal)}
        raise _args.ArgumentError(
            f"{_label(call, setter, pair)}: a device budget fixes the bytes kept, {goal} "
            f"plans them from a measured step: give one of the two "
            f'(device_budget="auto" with a goal)'
        )
    for option, (does, modes, who) in _HONOURED.items():
        value = getattr(options, option)
        if value is not None and mode not in modes:
            pair = {mode.value: getattr(options, mode.value), option: value}
            raise _args.ArgumentError(
                f"{_label(call, setter, pair)}: {option} {does} under {who} only; with "
                f"{mode} it would be ignored: leave {option} out (None)"
            )


def _label(call: str, setter: str | None, pair: dict[str, Any]) -> str:
    """``OffloadActivations(a=1, b=2)``, or for a setter of ``b``:
    ``OffloadActivations.b = 2 (with a=1)``."""
    if setter is None:
        return f"{call}({', '.join(f'{k}={v!r}' for k, v in pair.items())})"
    others = ", ".join(f"{k}={v!r}" for k, v in pair.items() if k != setter)
    return f"{call} = {pair.get(setter)!r} (with {others})"
