"""What a forward moves to the host and what stays on the device: the plan.

Every plan is a :class:`Split`: it moves a *prefix* of a forward's saved storages (in the
order they were saved) and keeps the rest: the earliest saved are needed last by backward,
so their copies have the longest to go out and come back. The manager's
:class:`~leakfree.offload.options.Mode` chooses how long the prefix is:

* the automatic budget or ``device_budget`` (bytes): the latest saved storages that fit
  in the budget stay (:func:`_moved_under`);
* ``max_overhead`` (a fraction of the step): the longest prefix whose predicted stall is
  within that fraction of the step's compute (:func:`choose`);
* ``device_limit`` (bytes the step may allocate on the device): the shortest prefix whose
  predicted peak is under it, none when the step fits (:func:`choose`).

The last two are planned from a :class:`Measurement` of one step on the device itself
(when each storage was saved, the forward's and backward's compute time, the copy
bandwidth each way, the step's peak), by :func:`predict`, a schedule of the copies: out
on one copy engine in the order saved, back on the other, each as early as its copy out
has ended, backward waiting where a copy back is late. Plain Python over numbers; it
owns no tensor.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

from leakfree.offload.options import Mode, Options

__all__ = [
    "Measurement",
    "OffloadPlan",
    "Planner",
    "Split",
    "choose",
    "head_start",
    "predict",
]


@dataclass(frozen=True)
class Measurement:
    """One step of a forward's shapes, measured on the device.

    ``sizes``: the saved storages' bytes, in the order saved; ``made``: seconds from the
    forward's start to each save; ``forward`` / ``backward``: seconds of each pass's
    compute (backward's as measured without copies, or estimated from the forward's);
    ``to_host`` / ``to_device``: copy bandwidths, bytes per second; ``peak``: the most
    the step allocates on the device beyond what it held before, moving nothing; and
    ``needed_at_peak``: the bytes of the latest saved storages backward has used by that
    peak (moving those lowers nothing); ``floor``: a peak no plan goes under (what
    backward allocates later on, as it brings back and makes its gradients)."""

    sizes: tuple[int, ...]
    made: tuple[float, ...]
    forward: float
    backward: float
    to_host: float
    to_device: float
    peak: int
    needed_at_peak: int = 0
    floor: int = 0


def _copies_out(m: Measurement, moved: int) -> list[float]:
    """When each of the first ``moved`` copies out ends: one at a time in the order saved,
    each once it is saved and the one before it is done."""
    end = 0.0
    ends = []
    for k in range(moved):
        end = max(m.made[k], end) + m.sizes[k] / m.to_host
        ends.append(end)
    return ends


def head_start(m: Measurement, moved: int) -> int:
    """Bytes of the earliest moved storages (which backward needs last) to bring back as
    soon as backward begins, while the last copies out still run: as many, in the order
    saved, as the copy back engine finishes before the last copy out ends (so they delay
    nothing), within the bytes the plan keeps (backward frees those first: the early
    ones take their room, not more)."""
    if moved < 2:
        return 0
    ends = _copies_out(m, moved)
    room = sum(m.sizes[moved:])
    engine, total = m.forward, 0
    for k in range(moved - 1):
        engine = max(ends[k], engine) + m.sizes[k] / m.to_device
        if engine > ends[-1] or total + m.sizes[k] > room:
            break
        total += m.sizes[k]
    return total


def predict(m: Measurement, moved: int, early: int | None = None) -> tuple[float, int]:
    """The stall (seconds) and the peak (bytes) of a step that moves ``m``'s first
    ``moved`` storages, bringing ``early`` bytes of them back ahead (default:
    :func:`head_start`'s).

    The forward does not wait for its copies out (their memory is the copy stream's until
    they end). Backward needs storage ``k`` after ``backward * (forward - made[k]) /
    forward`` seconds of its compute (the forward, mirrored), plus what it waited so far.
    Copies back run one at a time, each once its copy out is done: the early ones first,
    from the forward's end, then the rest in the order backward needs them. The peak
    falls by the bytes moved, but for the latest ones backward needs by its peak, and not
    under the measured floor."""
    sizes, made = m.sizes, m.made
    ends = _copies_out(m, moved)
    if early is None:
        early = head_start(m, moved)
    engine = m.forward  # the copy back engine is free from the forward's end on
    first = 0  # the early ones: the first storages, up to ``early`` bytes
    while first < moved and sizes[first] <= early:
        early -= sizes[first]
        engine = max(ends[first], engine) + sizes[first] / m.to_device
        first += 1
    rate = m.backward / m.forward if m.forward > 0 else 0.0
    stall = 0.0
    for k in range(moved - 1, first - 1, -1):
        engine = max(ends[k], engine) + sizes[k] / m.to_device
        need = m.forward + stall + rate * (m.forward - made[k])
        stall += max(0.0, engine - need)
    lowers = sum(sizes) - m.needed_at_peak
    peak = max(m.peak - min(sum(sizes[:moved]), max(0, lowers)), m.floor)
    return stall, peak


def choose(
    m: Measurement,
    *,
    max_overhead: float | None = None,
    device_limit: int | None = None,
    allocated: int = 0,
) -> tuple[int, int]:
    """How many of ``m``'s first storages to move, and how many bytes of them to bring
    back early (:func:`head_start`; the hooks bring them back only while the device has
    room under the plan's ceiling, and a step over a limit makes the plan move more).

    ``device_limit``: of the plans whose predicted peak, on top of ``allocated`` (what
    the device held before the step), is at most the limit, the one with the least
    predicted stall, the fewest bytes among equals: nothing when the step fits, all when
    nothing does. ``max_overhead``: the most whose predicted stall is at most that
    fraction of the step's compute (with a limit too: among the plans under it)."""
    n = len(m.sizes)
    if device_limit is None:
        candidates = range(n + 1)
    else:
        fits = [k for k in range(n + 1) if allocated + predict(m, k, 0)[1] <= device_limit]
        candidates = range(fits[0], n + 1) if fits else range(n, n + 1)

    def early(moved: int) -> int:
        return head_start(m, moved)

    if max_overhead is None:  # the limit alone: the least stall
        best = min(candidates, key=lambda k: (predict(m, k, early(k))[0], k))
        return best, early(best)
    allowed = max_overhead * (m.forward + m.backward)
    best = candidates[0]
    for moved in candidates:
        if predict(m, moved, early(moved))[0] <= allowed:
            best = moved
    return best, early(best)


@dataclass(frozen=True)
class OffloadPlan:
    """What stays on the device and what moves to the host, per forward: the plan made
    from the last forward whose saved tensors it saw.

    ``mode``: what chose it (:class:`~leakfree.offload.options.Mode`: the automatic
    budget, an explicit ``device_budget``, ``max_overhead`` or ``device_limit``);
    ``budget``: the bytes of saved activations kept (the budget's, or what the goal's plan
    keeps); ``kept`` / ``moved``: how many copies, by storage; ``*_bytes``:
    their sizes, so ``moved_bytes`` go to the host in forward and back in backward.
    ``replans``: how many times a forward of another shape made a new plan. ``small``
    storages (``small_bytes`` in all), each under ``small_below`` bytes, stay on the
    device besides the budget's: too small to be worth moving (``keep_small``, without a
    budget). ``overhead``: the predicted stall, a fraction of the step's compute, and
    ``peak``: the step's predicted peak on the device, in bytes (goals only)."""

    budget: int
    kept: int
    kept_bytes: int
    moved: int
    moved_bytes: int
    replans: int
    small: int = 0
    small_bytes: int = 0
    small_below: int = 0
    mode: Mode = Mode.AUTO
    overhead: float | None = None
    peak: int | None = None

    def __str__(self) -> str:
        from leakfree._text import format_bytes

        small = ""
        if self.small:
            small = (
                f", and {self.small} small ones ({format_bytes(self.small_bytes)}, each "
                f"under {format_bytes(self.small_below)}) stay as well"
            )
        if self.mode is Mode.AUTO:
            head = f"automatic device budget {format_bytes(self.budget)}"
        elif self.mode is Mode.BUDGET:
            head = f"device budget {format_bytes(self.budget)}"
        else:
            head = self.mode.value
        predicted = ""
        if self.overhead is not None and self.peak is not None:
            predicted = (
                f"; predicted: {self.overhead:.1%} of the step's compute waiting for "
                f"copies, a peak of {format_bytes(self.peak)}"
            )
        return (
            f"{head}: {self.kept} saved tensors "
            f"({format_bytes(self.kept_bytes)}) stay on the device, {self.moved} "
            f"({format_bytes(self.moved_bytes)}) go to the host and back{small}; "
            f"{self.replans} re-plan(s){predicted}"
        )


def _moved_under(sizes: list[int] | tuple[int, ...], budget: int) -> int:
    """How many of ``sizes`` (a forward's copies, in creation order) move: the earliest
    ones, which backward needs last. The kept ones are the latest that fit in ``budget``
    together; the first that does not fit, and all before it, move."""
    kept = 0
    for i in range(len(sizes) - 1, -1, -1):
        if kept + sizes[i] > budget:
            return i + 1
        kept += sizes[i]
    return 0


#: the smallest saved storages stay on the device while they add up to at most this
#: fraction (1 / _SMALL_SHARE) of the bytes a forward saves
_SMALL_SHARE = 64


def _small_below(sizes: list[int]) -> int:
    """The size under which saved storages stay on the device: the smallest of ``sizes``
    (a forward's saved storages, in bytes), as long as together they are at most
    1 / ``_SMALL_SHARE`` of all of them; all of one size or none. 0: none stays."""
    allowance = sum(sizes) // _SMALL_SHARE
    kept = 0
    for n, count in sorted(Counter(sizes).items()):
        if kept + n * count > allowance:
            return n if kept else 0
        kept += n * count
    return 0  # only when every size is 0


#: a group holds at most this fraction (1 / _GROUP_SHARE) of the bytes a forward moves
_GROUP_SHARE = 8

#: a budget nothing reaches (a step measured for ``max_overhead`` keeps everything)
_UNLIMITED = 1 << 62


class Split(NamedTuple):
    """A plan of one forward's shapes: its saved storages' bytes in the order saved
    (``sizes``) and how many of the first move (``moved``); the rest stay."""

    sizes: tuple[int, ...]
    moved: int


class Planner:
    """What one :class:`~leakfree.offload.OffloadActivations` has decided to move: its
    :class:`~leakfree.offload.options.Options` (and so its mode), the :class:`Split` of the
    last forward of each shape, and what a goal's plan predicted. Numbers only: the
    other parts measure and move, this decides.

    ``split``: None until a forward (a budget's) or a measured step (a goal's) made one."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.split: Split | None = None
        #: storages smaller than this stay where they are (the automatic budget's); and
        #: how many of the planned forward's storages that kept, with their bytes
        self.small_below = 0
        self.small_kept = (0, 0)
        #: what a group may hold: batch_bytes, at most an eighth of what the last planned
        #: forward moved; 0 (every copy alone) until a forward has been planned
        self.capacity = 0
        self.replans = -1
        #: a goal's plan: its predicted overhead and peak (bytes on the device); the bytes
        #: it brings back early, and what they stay under (less ``rises``, by position in
        #: backward's order); under a limit, the measurement it came from and what the
        #: device held then, until a step under it has held the limit
        self.prediction: tuple[float, int] | None = None
        self.early = 0
        self.ceiling = 0
        self.rises: tuple[int, ...] = ()
        self.check: tuple[Measurement, int] | None = None

    @property
    def mode(self) -> Mode:
        return self.options.mode

    def set(self, options: Options) -> None:
        """New options (checked): a change makes the next forward plan, or be measured,
        again, as a first forward is. (Kept as it was, a plan would not change while the
        shapes stay.)"""
        if options != self.options:
            self.forget()
        self.options = options

    def forget(self) -> None:
        """The next forward plans (or is measured) again, as a first forward is."""
        self.split = None
        self.small_below = 0
        self.check = None

    def budget(self, sizes: tuple[int, ...] | list[int] | None = None, *, on_plan: bool) -> int:
        """The bytes of saved activations kept on the device: the device budget given, or
        (the automatic budget) twice the largest copy of a forward (``sizes``; by default
        the planned one): what backward's prefetch would bring back at once anyway. A
        goal's plan keeps what it does not move (``on_plan``: the forward follows it); a
        step measured for one keeps everything, or (under a limit) moves everything."""
        mode = self.options.mode
        if mode is Mode.BUDGET:
            return self.options.device_budget  # type: ignore[return-value]
        if mode.goal:
            if self.split is not None and on_plan:
                return sum(self.split.sizes)
            return 0 if mode is Mode.LIMIT else _UNLIMITED
        if sizes is None:
            sizes = self.split.sizes if self.split is not None else ()
        return 2 * max(sizes, default=0)

    def from_forward(self, sizes: list[int], storages: list[int], saved: list[int]) -> None:
        """Plan the next forwards from one that did not follow the plan (a budget's):
        ``sizes``, its copies' bytes in the order saved; ``storages``, each copy's storage
        bytes; ``saved``, every storage it saved, once.

        The automatic budget also keeps the smallest saved storages on the device
        (``keep_small``), while together they are at most 1/64 of what the forward saves:
        each costs a handle, a host copy, its part of a transfer each way and a view in
        backward, whatever its size, and its bytes would save next to nothing. The rule
        weighs every storage the forward saved (the ones it kept for their size among
        them), so a forward of the same shapes makes the same choice again."""
        below = _small_below(saved) if self.options.keeps_small else 0
        kept = [n for n in saved if n < below]
        planned = [n for n, s in zip(sizes, storages) if s >= below]  # the copies to come
        moved = _moved_under(planned, self.budget(planned, on_plan=False))
        self.split = Split(tuple(planned), moved)
        self.small_below = below
        self.small_kept = (len(kept), sum(kept))
        self.replans += 1
        self._group_capacity(planned, moved)

    def _group_capacity(self, sizes: list[int] | tuple[int, ...], moved: int) -> None:
        # A group is on the device twice (waiting to be sent, and brought back until its
        # last use): bounded by an eighth of what a forward moves, grouping adds at most
        # about that to the device peak, however small the model.
        self.capacity = min(self.options.batch_bytes, sum(sizes[:moved]) // _GROUP_SHARE)

    def adopt(self, measurement: Measurement, allocated: int, *, checkable: bool) -> None:
        """A goal's plan from ``measurement`` (``allocated``: what the device held before
        the measured step). Under a limit, and where the device reports its peak
        (``checkable``), the next step's peak is checked against it (:meth:`checked`)."""
        sizes = measurement.sizes
        limit = self.options.device_limit
        count, self.early = choose(
            measurement,
            max_overhead=self.options.max_overhead,
            device_limit=limit,
            allocated=allocated,
        )
        stall, peak = predict(measurement, count, self.early)
        compute = measurement.forward + measurement.backward
        self.prediction = (stall / compute if compute > 0 else 0.0, allocated + peak)
        # what bringing groups back early stays under: the plan's ceiling (less, at each
        # point of backward, how far the measured backward rose above it later: ``rises``)
        self.ceiling = allocated + peak
        if limit is not None:
            self.ceiling = max(self.ceiling, limit)
        self.split = Split(sizes, count)
        self.small_below = 0
        self.small_kept = (0, 0)
        self._group_capacity(sizes, count)
        limited = limit is not None and checkable and count < len(sizes)
        self.check = (measurement, allocated) if limited else None

    def checked(self, peak: int) -> None:
        """A step under a limit's new plan peaked at ``peak`` bytes on the device: over the
        limit, the plan's prediction of its peak was short by what the step went over it,
        and a plan moving more follows (checked again); else the plan stands."""
        limit = self.options.device_limit
        if self.check is None or limit is None or self.prediction is None:
            raise RuntimeError("leakfree: a plan was checked without a limit; please report this")
        measurement, allocated = self.check
        if peak <= limit:
            self.check = None
            return
        short = peak - self.prediction[1]
        corrected = dataclasses.replace(
            measurement, peak=measurement.peak + short, floor=measurement.floor + short
        )
        self.adopt(corrected, allocated, checkable=True)

    def report(self) -> OffloadPlan | None:
        """The plan as :class:`OffloadPlan` (None before there is one)."""
        if self.split is None:
            return None
        sizes, moved = self.split
        small, small_bytes = self.small_kept
        mode = self.options.mode
        overhead, peak = None, None
        if mode.goal and self.prediction is not None:
            overhead, peak = self.prediction
        return OffloadPlan(
            budget=sum(sizes[moved:]) if mode.goal else self.budget(on_plan=True),
            kept=len(sizes) - moved,
            kept_bytes=sum(sizes[moved:]),
            moved=moved,
            moved_bytes=sum(sizes[:moved]),
            replans=max(self.replans, 0),
            small=small,
            small_bytes=small_bytes,
            small_below=self.small_below,
            mode=mode,
            overhead=overhead,
            peak=peak,
        )
