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

from leakfree._allocator import Counts
from leakfree.offload.options import Mode, Options

__all__ = [
    "Measurement",
    "OffloadPlan",
    "Planner",
    "Prediction",
    "Split",
    "choose",
    "head_start",
    "in_flight",
    "predict",
]


@dataclass(frozen=True)
class Measurement:
    """One step of a forward's shapes, measured on the device.

    ``sizes``: the saved storages' bytes, in the order saved; ``made``: seconds from the
    forward's start to each save, of compute (what the step waited for its copies left
    out); ``forward`` / ``backward``: seconds of each pass's compute (backward's as
    measured without copies, or estimated from the forward's); ``to_host`` /
    ``to_device``: copy bandwidths, bytes per second; ``peak``: the most the step
    allocates on the device beyond what it allocated before, moving nothing; and
    ``needed_at_peak``: the bytes of the latest saved storages backward has used by that
    peak (moving those lowers nothing); ``floor``: a peak no plan goes under (what
    backward allocates later on, as it brings back and makes its gradients); ``spare``:
    what the device held beyond what it allocated at its peak (the caching allocator's
    rounding, splits and blocks still read by a copy); ``duplex``: the share of its rate
    each direction keeps while the other one copies (1: a full-duplex link;
    :mod:`leakfree.offload.link`); ``gap``: seconds of compute between the forward's end
    and backward's first unpack (the loss, the head's backward)."""

    sizes: tuple[int, ...]
    made: tuple[float, ...]
    forward: float
    backward: float
    to_host: float
    to_device: float
    peak: int
    needed_at_peak: int = 0
    floor: int = 0
    spare: int = 0
    duplex: float = 1.0
    gap: float = 0.0

    def scaled(self, sizes: tuple[int, ...]) -> Measurement:
        """This step as it would be with the same tensors of ``sizes`` (a forward of other
        lengths): times and bytes in proportion to what the forward saves."""
        r = sum(sizes) / max(sum(self.sizes), 1)
        return dataclasses.replace(
            self,
            sizes=sizes,
            made=tuple(t * r for t in self.made),
            forward=self.forward * r,
            backward=self.backward * r,
            peak=int(self.peak * r),
            needed_at_peak=int(self.needed_at_peak * r),
            floor=int(self.floor * r),
            spare=int(self.spare * r),
            gap=self.gap * r,
        )


class Prediction(NamedTuple):
    """A plan's step, predicted: ``stall``, the seconds it waits for copies (the forward
    where its window is full, backward for its copies back); ``peak``, the bytes it
    allocates at its peak beyond what was allocated before; ``held``, what the device
    holds then (the peak, and the measured spare)."""

    stall: float
    peak: int
    held: int


class _Schedule(NamedTuple):
    ends: list[float]  #: when each copy out ends
    delay: float  #: how long the forward waited for them
    window: list[int]  #: after each save, the bytes of moved tensors the window holds


def _schedule(m: Measurement, moved: int, cap: int | None) -> _Schedule:
    """The first ``moved`` copies out, one at a time in the order saved, each once it is
    saved and the one before it is done, and the window that keeps their tensors alive
    while they run. At each save the window lets go of the tensors whose copies have
    ended by then (in stream order: the compute stream waits for a copy that has ended,
    which costs nothing), and, beyond ``cap`` bytes (None: none), of the oldest whose
    copies still run: there the forward waits for them. (The host runs ahead of the
    device, so the hooks cannot see a copy end: the window they keep is this one,
    computed ahead, :attr:`Planner.in_flight`. One that let tensors go only as it filled
    up would keep them well after their copies end, at the step's peak too.)"""
    sizes, made, rate = m.sizes, m.made, m.to_host
    end = delay = 0.0
    ends: list[float] = []
    window: list[int] = []
    first = held = 0  # the oldest moved tensor the window holds, and the bytes it holds
    for k in range(len(sizes)):
        now = made[k] + delay
        if k < moved:
            end = max(now, end) + sizes[k] / rate
            ends.append(end)
            held += sizes[k]
        last = min(k + 1, moved)
        while first < last and ends[first] <= now:
            held -= sizes[first]
            first += 1
        while cap is not None and held > cap and first < last:
            delay += max(0.0, ends[first] - now)
            now = made[k] + delay
            held -= sizes[first]
            first += 1
        window.append(held)
    return _Schedule(ends, delay, window)


def head_start(m: Measurement, moved: int, cap: int | None = None) -> int:
    """Bytes of the earliest moved storages (which backward needs last) to bring back as
    soon as backward begins, while the last copies out still run: as many, in the order
    saved, as the copy back engine finishes before the last copy out ends (so they delay
    nothing), within the bytes the plan keeps (backward frees those first: the early
    ones take their room, not more)."""
    if moved < 2:
        return 0
    schedule = _schedule(m, moved, cap)
    return _head_start(m, moved, schedule.ends, m.forward + schedule.delay)


def _head_start(m: Measurement, moved: int, ends: list[float], begins: float) -> int:
    room = sum(m.sizes[moved:])
    candidates = []
    total = 0
    for k in range(moved - 1):
        if total + m.sizes[k] > room:
            break
        total += m.sizes[k]
        candidates.append(k)
    back, last_out = _copies_back(m, moved, ends, begins, candidates)
    early = 0
    for k in candidates:
        if back[k] > last_out:
            break
        early += m.sizes[k]
    return early


def _copies_back(
    m: Measurement, moved: int, ends: list[float], begins: float, order: list[int]
) -> tuple[dict[int, float], float]:
    """When each copy back of ``order`` (storage indices, in the order issued) ends, and
    when the last copy out ends: copies back run one at a time from ``begins`` (the
    forward's end), each once its copy out has ended (``ends``: the copies out as
    scheduled alone). While both directions copy, each runs at ``m.duplex`` of its rate:
    the copies out still running as backward begins are slowed too, and so end later."""
    sizes, share, to_host, to_device = m.sizes, m.duplex, m.to_host, m.to_device
    done: dict[int, float] = {}
    t = begins
    if share >= 1.0 or moved == 0:
        for k in order:
            t = done[k] = max(t, ends[k]) + sizes[k] / to_device
        return done, ends[moved - 1] if moved else begins
    # the copies out still running at ``begins`` run back to back from there: ``i`` the
    # first of them, with ``left`` seconds to go at its full rate
    i = next((k for k in range(moved) if ends[k] > begins), moved)
    left = ends[i] - begins if i < moved else 0.0
    last_out = ends[i - 1] if i > 0 else begins
    for k in order:
        while k >= i:  # its copy out still runs: the copies out alone until it has ended
            t += left
            last_out = t
            i += 1
            left = sizes[i] / to_host if i < moved else 0.0
        back = sizes[k] / to_device  # seconds to go at its full rate
        while back > 0.0:
            if i >= moved:  # no copy out left: the full rate
                t += back
                break
            step = min(back, left) / share  # until one of the two ends
            t += step
            back -= step * share
            left -= step * share
            if left <= 1e-12:
                last_out = t
                i += 1
                left = sizes[i] / to_host if i < moved else 0.0
        done[k] = t
    if i < moved:  # the copies out that outlast the copies back: alone
        last_out = t + left + sum(sizes[i + 1 : moved]) / to_host
    return done, last_out


def predict(
    m: Measurement, moved: int, early: int | None = None, cap: int | None = None
) -> Prediction:
    """The step that moves ``m``'s first ``moved`` storages, its window capped at ``cap``
    bytes (None: uncapped; see :func:`_schedule`), bringing ``early`` bytes of them back
    ahead (default: :func:`head_start`'s).

    Backward needs storage ``k`` after ``backward * (forward - made[k]) / forward``
    seconds of its compute (the forward, mirrored), plus what it waited so far. Copies
    back run one at a time, each once its copy out is done: the early ones first, from
    the forward's end, then the rest in the order backward needs them; where they run
    beside the last copies out, each direction at the link's ``duplex`` share
    (:func:`_copies_back`). The peak falls by the bytes moved, but for the latest ones
    backward needs by its peak, and not under the measured floor; it rises by what the
    window holds as the forward ends (those tensors are allocated until ``__exit__``,
    and held until their copies end after it). What is held adds the measured spare."""
    sizes, made = m.sizes, m.made
    schedule = _schedule(m, moved, cap)
    ends, begins = schedule.ends, m.forward + schedule.delay
    if early is None:
        early = _head_start(m, moved, ends, begins) if moved >= 2 else 0
    first = 0  # the early ones: the first storages, up to ``early`` bytes
    while first < moved and sizes[first] <= early:
        early -= sizes[first]
        first += 1
    order = list(range(first)) + list(range(moved - 1, first - 1, -1))
    back, _ = _copies_back(m, moved, ends, begins, order)
    rate = m.backward / m.forward if m.forward > 0 else 0.0
    stall = schedule.delay
    for k in range(moved - 1, first - 1, -1):
        need = m.forward + stall + rate * (m.forward - made[k])
        stall += max(0.0, back[k] - need)
    held_at_end = schedule.window[-1] if schedule.window else 0
    peak = _peak(m, sum(sizes[:moved])) + held_at_end
    return Prediction(stall, peak, peak + m.spare)


def _peak(m: Measurement, moved_bytes: int) -> int:
    lowers = sum(m.sizes) - m.needed_at_peak
    return max(m.peak - min(moved_bytes, max(0, lowers)), m.floor)


def _caps(m: Measurement) -> list[int | None]:
    """The window caps a goal's plan chooses among: none, then from all a forward saves
    down, halving, to a 1024th of it."""
    total = sum(m.sizes)
    out: list[int | None] = [None]
    cap = total
    while cap >= max(total // 1024, 1):
        out.append(cap)
        cap //= 2
    return out


def choose(
    m: Measurement,
    *,
    max_overhead: float | None = None,
    device_limit: int | None = None,
    allocated: int = 0,
) -> tuple[int, int, int | None]:
    """How many of ``m``'s first storages to move, how many bytes of them to bring back
    early (:func:`head_start`; the hooks bring them back only while the device has room
    under the plan's ceiling), and the window's cap (:func:`_schedule`).

    ``device_limit``: of the plans that hold, with ``allocated`` (what the device held
    before the step), at most the limit, the one with the least predicted stall, the
    fewest bytes among equals: nothing when the step fits, all with the smallest cap
    when nothing does. ``max_overhead``: of the plans whose predicted stall is at most
    that fraction of the step's compute (with a limit too: among the plans under it),
    the one that holds the least. For each cap, the bytes moved are found by bisection:
    a plan that moves more waits at least as long, and (its cap bounding what the window
    holds) holds no more.

    A forward of many storages is searched over at most :data:`_UNITS` units of
    consecutive ones (about equal in bytes), then at full resolution within the units
    around the boundary chosen: a few schedules of every storage, not one per candidate."""
    allowed = None if max_overhead is None else max_overhead * (m.forward + m.backward)
    room = None if device_limit is None else device_limit - allocated
    coarse, bounds = _coarse(m)
    chosen = _search(coarse, allowed, room)
    if chosen is None:  # nothing is under the limit: everything moves, the smallest cap
        cap = _caps(m)[-1]
        return len(m.sizes), head_start(m, len(m.sizes), cap), cap
    units, cap = chosen
    moved = bounds[units]
    if coarse is not m:
        low, high = bounds[max(0, units - 1)], bounds[min(len(bounds) - 1, units + 1)]
        if room is not None:
            moved = low = _fewest_under(m, cap, room, low, high)
        if allowed is not None:
            moved = _most_within(m, cap, allowed, low, high)
    return moved, head_start(m, moved, cap), cap


def _search(
    m: Measurement, allowed: float | None, room: int | None
) -> tuple[int, int | None] | None:
    """The bytes moved and the cap :func:`choose` picks (None: no plan is under the
    limit), searching every cap and storage of ``m``."""
    n = len(m.sizes)
    best: tuple[tuple[float, ...], int, int | None] | None = None
    for cap in _caps(m):
        low = 0
        if room is not None:  # the fewest moved under the limit
            if predict(m, n, 0, cap).held > room:
                continue
            low = _fewest_under(m, cap, room, 0, n)
        moved = low
        if allowed is not None:  # the most moved within the time allowed
            moved = _most_within(m, cap, allowed, low, n)
        p = predict(m, moved, cap=cap)
        if allowed is None or p.stall > allowed:
            key: tuple[float, ...] = (0.0, p.stall, moved, -(cap or 0))  # least stall
        else:
            key = (-1.0, p.held, p.stall, -(cap or 0))  # within the time: least held
        if best is None or key < best[0]:
            best = (key, moved, cap)
    return None if best is None else (best[1], best[2])


def _fewest_under(m: Measurement, cap: int | None, room: int, low: int, high: int) -> int:
    """The fewest storages in ``[low, high]`` to move for a held peak within ``room``
    (``high`` if none is)."""
    while low < high:
        mid = (low + high) // 2
        if predict(m, mid, 0, cap).held <= room:
            high = mid
        else:
            low = mid + 1
    return low


def _most_within(m: Measurement, cap: int | None, allowed: float, low: int, high: int) -> int:
    """The most storages in ``[low, high]`` to move for a stall within ``allowed``
    seconds (``low`` if none is)."""
    while low < high:
        mid = (low + high + 1) // 2
        if predict(m, mid, cap=cap).stall <= allowed:
            low = mid
        else:
            high = mid - 1
    return low


#: a goal's plan is searched over at most this many units of consecutive storages
_UNITS = 96


def _coarse(m: Measurement) -> tuple[Measurement, list[int]]:
    """``m`` with its storages merged into at most :data:`_UNITS` runs of consecutive
    ones, about equal in bytes (each saved when its last one was), and where each run
    begins: ``bounds[u]`` storages are in the first ``u`` runs. ``m`` itself when it has
    no more storages than that."""
    n = len(m.sizes)
    if n <= _UNITS:
        return m, list(range(n + 1))
    share = max(1, sum(m.sizes) // _UNITS)
    bounds, sizes, made = [0], [], []
    total = 0
    for k, size in enumerate(m.sizes):
        total += size
        if total >= share or k == n - 1:
            bounds.append(k + 1)
            sizes.append(total)
            made.append(m.made[k])
            total = 0
    return dataclasses.replace(m, sizes=tuple(sizes), made=tuple(made)), bounds


def in_flight(m: Measurement, moved: int, cap: int | None) -> tuple[int, ...]:
    """The window a plan keeps at each of ``m``'s saves (:func:`_schedule`)."""
    return tuple(_schedule(m, moved, cap).window)


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
    budget). ``overhead``: the predicted stall, a fraction of the step's compute;
    ``peak``: the step's predicted peak on the device, in bytes, as the caching allocator
    counts it allocated; ``held``: what the device then holds (reserved: the allocated,
    and the memory of copies still running and the allocator's spare), which decides an
    out-of-memory error (goals only). ``measured_overhead`` / ``measured_held``: what the
    step that checked the plan measured of the same (None until one has: the step after
    a new plan, where the device reports its allocator)."""

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
    held: int | None = None
    measured_overhead: float | None = None
    measured_held: int | None = None

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
            held = f", held {format_bytes(self.held)}" if self.held is not None else ""
            predicted = (
                f"; predicted: {self.overhead:.1%} of the step's compute waiting for "
                f"copies, a peak of {format_bytes(self.peak)} allocated{held}"
            )
            if self.measured_overhead is not None and self.measured_held is not None:
                predicted += (
                    f"; measured: {self.measured_overhead:.1%} waiting, held "
                    f"{format_bytes(self.measured_held)}"
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

#: a budget's window holds at most this fraction (1 / _WINDOW_SHARE) of what a forward
#: moves: on the H100 model, the default's step at 1/8 is 2.57x with 41.7% less held than
#: no offloading; at 5 copies (TRL's window), 2.64x and 43.0%
_WINDOW_SHARE = 8

#: a limit's plan keeps a _SLACK-th of the limit under it; one that holds less than the
#: limit by more than twice that is corrected to move less; a plan is corrected at most
#: _CORRECTIONS times in a row (but over a limit)
_SLACK = 16
_CORRECTIONS = 6
#: a checked step's stall may part from the prediction by this much of the step's compute
#: (and a quarter of the prediction) before the plan is made again
_STALL_MARGIN = 0.02
#: or, under a time cap, when the step went over the cap by more than this fraction of it
_OVER_CAP = 0.05

#: a forward whose copies are at least this fraction of the plan's, place by place, is of
#: the plan's lengths (a step checked against a limit's plan must be)
_SAME = 0.98

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
        #: a goal's plan: its predicted overhead, peak allocated and peak held (bytes on
        #: the device); the bytes it brings back early, and what they stay under (less
        #: ``rises``, by position in backward's order); under a limit, the measurement it
        #: came from and what the device held then, until a step under it has held the limit
        self.prediction: tuple[float, int, int] | None = None
        self.early = 0
        self.ceiling = 0
        self.rises: tuple[int, ...] = ()
        self.check: tuple[Measurement, int, int] | None = None
        #: the plan chosen (storages moved, bytes brought back early, the window's cap),
        #: and what the step that checked it measured (its overhead, None where it was
        #: not timed; what it held), None until one has
        self.chosen: tuple[int, int, int | None] = (0, 0, None)
        self.observed: tuple[float | None, int] | None = None
        #: a budget's window: the bytes of device tensors kept alive while their copies out
        #: run, beyond which the compute stream waits for the oldest (None: no plan yet);
        #: a goal's, as its schedule says at each save (:func:`in_flight`), and the save
        #: this forward is at
        self.window_bytes: int | None = None
        self.in_flight: tuple[int, ...] = ()
        #: where the forward is (the place of its latest copy), and how much larger its
        #: copies are so far than the planned forward's at that place (at least 1; a
        #: forward of other lengths follows the plan by place, scaled)
        self.at = 0
        self.scale = 1.0
        self.ratio = 1.0  #: the same, at the latest place (below 1: shorter lengths)
        #: the first place's ratio in the last forward, and whether this forward's differs
        #: from it by more than 2% (other lengths than the step before)
        self.lengths = 1.0
        self.relengthed = False
        self._prefix: list[int] = [0]  # the planned forward's bytes, cumulated
        #: what the device held before the measured step (a goal's plan), and the
        #: measurement the plan came from
        self.before = 0
        self.measured: Measurement | None = None

    @property
    def mode(self) -> Mode:
        return self.options.mode

    def follow(self, at: int, saved: int) -> None:
        """The forward made its copy at place ``at``, ``saved`` bytes of copies so far:
        the window and a limit's budget follow it (:attr:`scale`: only up, in a forward)."""
        self.at = at
        prefix = self._prefix
        if at == 0:
            self.scale = 1.0
        if at + 1 < len(prefix) and prefix[at + 1] > 0:
            self.ratio = saved / prefix[at + 1]
            self.scale = max(self.scale, self.ratio)
            if at == 0:  # this forward's lengths, against the last one's
                last, self.lengths = self.lengths, self.ratio
                self.relengthed = abs(self.ratio - last) > (1 - _SAME) * last

    def window(self) -> tuple[int | None, int | None]:
        """How many bytes and tensors (None: any) the window keeps alive while their
        copies out run: a goal's plan, what its schedule says is still copying at this
        save (:func:`in_flight`); ``max_fwd_stash_size`` copies where given; a budget's
        plan, an eighth of what it moves (the copies out may fall that far behind the
        forward before it waits for them); before any plan, 5 copies."""
        options = self.options
        if options.mode.goal and self.in_flight:
            flights = self.in_flight
            return int(flights[min(self.at, len(flights) - 1)] * self.scale), None
        if options.max_fwd_stash_size is None and self.window_bytes is not None:
            return self.window_bytes, None
        return None, options.stash

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
        self.observed = None
        self.window_bytes = None
        self.in_flight = ()

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
                return self._kept_under_limit() if mode is Mode.LIMIT else _UNLIMITED
            return 0 if mode is Mode.LIMIT else _UNLIMITED
        if sizes is None:
            sizes = self.split.sizes if self.split is not None else ()
        return 2 * max(sizes, default=0)

    def overshot(self, held: int) -> None:
        """A step that followed a limit's checked plan held ``held`` bytes: over the limit
        (the caching allocator's blocks of other lengths, which no prediction sees), the
        plan is made again to move that much more, and checked."""
        limit, measured = self.options.device_limit, self.measured
        if limit is None or measured is None or held <= limit:
            return
        spare = measured.spare + (held - limit)
        self.adopt(dataclasses.replace(measured, spare=spare), self.before, checkable=True)

    def outgrown(self, sizes: tuple[int, ...]) -> bool:
        """A forward that followed a limit's plan saved larger tensors than the plan's
        (by more than 2%): the plan is made again for them, from the measured step scaled
        (:meth:`Measurement.scaled`), and checked by the next step of these lengths. (The
        forward itself kept less than the plan, as :meth:`_kept_under_limit` says.)
        Whether it was."""
        measured = self.measured
        if self.options.mode is not Mode.LIMIT or measured is None or self.scale <= 2 - _SAME:
            return False
        self.adopt(measured.scaled(sizes), self.before, checkable=self.check is not None)
        self.replans += 1
        return True

    def _kept_under_limit(self) -> int:
        """The bytes a limit's plan keeps on the device in a forward that follows it: the
        plan's, in a forward of its lengths; in a larger one (:attr:`scale`), less what
        the rest of the step then holds more, so the step stays under the limit (the
        earliest kept ones move: :meth:`Keeper.place`)."""
        split, prediction, limit = self.split, self.prediction, self.options.device_limit
        if split is None or prediction is None or limit is None:
            return _UNLIMITED
        kept = sum(split.sizes[split.moved :])
        if self.scale <= 1.0:
            return kept
        rest = prediction[2] - self.before - kept  # what the step holds but the kept
        return max(0, int(limit - self.before - self.scale * rest))

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
        prefix = self._prefix = [0]
        for size in sizes:
            prefix.append(prefix[-1] + size)
        # A group is on the device twice (waiting to be sent, and brought back until its
        # last use): bounded by an eighth of what a forward moves, grouping adds at most
        # about that to the device peak, however small the model.
        self.capacity = min(self.options.batch_bytes, sum(sizes[:moved]) // _GROUP_SHARE)
        if not self.options.mode.goal:
            self.window_bytes = sum(sizes[:moved]) // _WINDOW_SHARE

    def adopt(
        self, measurement: Measurement, allocated: int, *, checkable: bool, corrections: int = 0
    ) -> None:
        """A goal's plan from ``measurement`` (``allocated``: what the device held before
        the measured step). Where the device reports its allocator (``checkable``), the
        next step of these shapes checks it (:meth:`checked`; ``corrections``: how many
        times it was corrected in a row so far)."""
        sizes = measurement.sizes
        limit = self.options.device_limit
        count, early, cap = choose(
            measurement,
            max_overhead=self.options.max_overhead,
            # a margin under the limit: what the prediction cannot see (the caching
            # allocator's blocks of other lengths) must not take a step over it
            device_limit=None if limit is None else limit - limit // _SLACK,
            allocated=allocated,
        )
        self.early = early
        self.chosen = (count, early, cap)
        p = predict(measurement, count, early, cap)
        compute = measurement.forward + measurement.backward
        overhead = p.stall / compute if compute > 0 else 0.0
        self.prediction = (overhead, allocated + p.peak, allocated + p.held)
        # what bringing groups back ahead stays under without a limit (:meth:`room`): the
        # plan's predicted peak, in the allocator's allocated count
        self.ceiling = allocated + p.peak
        self.split = Split(sizes, count)
        self.small_below = 0
        self.small_kept = (0, 0)
        self._group_capacity(sizes, count)
        self.in_flight = in_flight(measurement, count, cap)
        self.before = allocated
        self.measured = measurement
        self.check = (measurement, allocated, corrections) if checkable else None

    def room(self, position: int, counts: Counts) -> int:
        """Bytes backward may bring back ahead of use now, at ``position`` in its order
        (the device's allocator reads ``counts``): under a limit, what the limit leaves
        (less its margin and what the device holds beyond what it allocates, the measured
        spare) over what is allocated now and how far the measured backward rose later
        than this point (``rises``); else, what the plan's predicted peak leaves over what
        is allocated, less the same rise."""
        rises = self.rises
        rise = rises[position] if 0 <= position < len(rises) else 0
        limit = self.options.device_limit
        if limit is not None:
            spare = self.measured.spare if self.measured is not None else 0
            return limit - limit // _SLACK - spare - rise - counts.allocated
        return self.ceiling - rise - counts.allocated

    def checked(self, held: int, seconds: float | None = None) -> None:
        """The step after a goal's new plan held at most ``held`` bytes on the device and
        took ``seconds`` from its forward's start to its backward's end (None: not
        timed). What it measured is kept for ``ctx.plan`` (:attr:`observed`), and the
        plan is made again (and checked in turn) where the step parted from its
        prediction:

        * over a limit: the prediction of what the step holds was short by what it went
          over; a plan moving more follows;
        * its stall off the prediction by more than :data:`_STALL_MARGIN` of the step's
          compute and a quarter of the prediction, or over a time cap by more than
          :data:`_OVER_CAP` of it: the link ran slower or faster beside the step than its
          probe said; its rates are scaled until the schedule waits as long as the step
          did (:meth:`_link_fitted`), and the plan is chosen again;
        * under a limit, far under it (by more than a 16th of the limit, twice the margin
          a plan keeps): a plan moving less follows, corrected by half what the
          prediction overstated (a plan that moves less lays the caching allocator's
          blocks out otherwise, and may hold more than this one did);
        * without a limit, what it held off the prediction by more than a 16th: the
          prediction is corrected (the plan does not change: a time cap's choice is
          its stall's).

        What the device holds beyond what it allocates is what the measured step predicts
        worst: those corrections are to its ``spare``. At most :data:`_CORRECTIONS`
        corrections but over a limit; then the plan stands."""
        if self.check is None or self.prediction is None or self.split is None:
            raise RuntimeError("leakfree: a plan was checked without one; please report this")
        if self.ratio < _SAME:
            return  # a forward of shorter lengths: judged by a step of the plan's, later
        measurement, allocated, corrections = self.check
        predicted_overhead, _, predicted_held = self.prediction
        compute = measurement.forward + measurement.backward
        overhead = None
        if seconds is not None and compute > 0:
            overhead = max(0.0, (seconds - measurement.gap) / compute - 1.0)
        self.observed = (overhead, held)
        limit = self.options.device_limit
        moved = self.split.moved
        corrected = None
        if limit is not None and held > limit:
            spare = measurement.spare + max(held - predicted_held, held - limit)
            corrected = dataclasses.replace(measurement, spare=spare)
        elif corrections < _CORRECTIONS:
            cap = self.options.max_overhead
            margin = _STALL_MARGIN + predicted_overhead / 4
            parted = overhead is not None and (
                abs(overhead - predicted_overhead) > margin
                or (cap is not None and overhead > cap * (1 + _OVER_CAP))
            )
            # (a limit's plan is the least stall under it: its check is what it held)
            if parted and overhead is not None and moved > 0 and limit is None:
                corrected = self._link_fitted(measurement, overhead * compute)
            elif limit is not None and limit - held > 2 * (limit // _SLACK) and moved > 0:
                spare = max(0, measurement.spare - (predicted_held - held) // 2)
                corrected = dataclasses.replace(measurement, spare=spare)
            elif limit is None and abs(held - predicted_held) > predicted_held // _SLACK:
                spare = max(0, measurement.spare + held - predicted_held)
                corrected = dataclasses.replace(measurement, spare=spare)
        if corrected is None:
            self.check = None
            return
        over = limit is not None and held > limit  # not counted: the limit comes first
        self.adopt(corrected, allocated, checkable=True, corrections=corrections + (not over))

    def _link_fitted(self, m: Measurement, stall: float) -> Measurement:
        """``m`` with both copy rates scaled (by 1/16 to 4) so that the plan followed
        waits ``stall`` seconds as the step that checked it did."""
        moved, early, cap = self.chosen

        def scaled(scale: float) -> Measurement:
            return dataclasses.replace(m, to_host=m.to_host * scale, to_device=m.to_device * scale)

        def waits(scale: float) -> float:
            return predict(scaled(scale), moved, early, cap).stall

        low, high = -4.0, 2.0  # log2 of the scale
        for _ in range(24):
            mid = (low + high) / 2
            if waits(2.0**mid) > stall:
                low = mid  # still waits longer than the step: a faster link
            else:
                high = mid
        return scaled(2.0 ** ((low + high) / 2))

    def report(self) -> OffloadPlan | None:
        """The plan as :class:`OffloadPlan` (None before there is one)."""
        if self.split is None:
            return None
        sizes, moved = self.split
        small, small_bytes = self.small_kept
        mode = self.options.mode
        overhead = peak = held = None
        if mode.goal and self.prediction is not None:
            overhead, peak, held = self.prediction
        measured_overhead, measured_held = self.observed or (None, None)
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
            held=held,
            measured_overhead=measured_overhead,
            measured_held=measured_held,
        )
