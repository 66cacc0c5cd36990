"""Growth that stops: a run's whole history of live bytes, and whether its growth stopped.

A bounded store fills and then stays: a replay buffer of the last 64 transitions, an
``lru_cache(maxsize=24)``, optimizer state made lazily as layers unfreeze, a tokenizer's
cache. Judged over a window of the last steps while it fills, it grows like a leak; judged
over the whole run once the run ends, it grew and then stopped. :class:`History` keeps the
whole run's series (one value per step, thinned evenly when long); :func:`settled` says
whether its growth stopped, by the settings of :class:`~leakfree.diagnostics.rule.Rule`
(``flat_share``, ``flat_pauses``, ``flat_pace``, ``window``, ``floor``):

* the level the series ends at is the median of its last steps; it was reached at step
  ``b``, the first step within ``flat_pace`` of all the growth from that level (a cache's
  last stragglers are part of the flat stretch, not of the growth);
* the steps up to ``b`` grew, by the detector's own test (beyond noise and ``floor``, in
  both halves): a noisy series that never grew has nothing to report;
* the flat stretch after ``b`` lasts at least ``window`` steps, ``flat_share`` of the
  steps the growth took, and ``flat_pauses`` times the longest pause between two rises
  while it grew: a leak that adds a block every N steps pauses N - 1 steps between rises,
  and is never excused by a pause;
* over the stretch the series rises at under ``flat_pace`` of the growth's pace, and over
  its last ``window`` steps not at all, beyond noise and ``floor``: a slow leak after a
  large fill still grows at the end.

Kept, by a :class:`History`, for its run: at most :data:`MAX_POINTS` pairs of integers.
"""

from __future__ import annotations

import itertools
import statistics
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from leakfree._text import format_bytes
from leakfree.diagnostics.growth import fit_growth
from leakfree.diagnostics.rule import Rule

__all__ = ["MAX_POINTS", "History", "Plateau", "settled"]

#: a history keeps at most this many steps, evenly spaced (every other one is dropped when
#: full): a run of a million steps costs what one of 512 does
MAX_POINTS = 512


@dataclass(frozen=True)
class Plateau:
    """Growth that stopped: ``grown`` bytes over steps ``first``-``last``, then ``flat``
    steps without growth."""

    grown: float
    first: int
    last: int
    flat: int

    def __str__(self) -> str:
        return (
            f"grew by {format_bytes(self.grown)} over steps {self.first}-{self.last}, then "
            f"flat for {self.flat} steps"
        )


class History:
    """One value per step, for the whole run: every step while short, then one in 2, 4...
    (the latest always kept). Kept as machine integers (``array('q')``), not Python ones:
    a bounded history costs a bounded 8 KiB, not an object per step."""

    def __init__(self) -> None:
        self.at = array("q")  #: the step of each value
        self.values = array("q")
        self._stride = 1

    def add(self, step: int, value: int) -> None:
        if self.at and (self.at[-1] // self._stride) == (step // self._stride) and len(self.at) > 1:
            self.at[-1], self.values[-1] = step, value  # stands in for its stride
        else:
            self.at.append(step)
            self.values.append(value)
        if len(self.at) > MAX_POINTS:
            del self.at[1::2], self.values[1::2]
            self._stride *= 2

    def __len__(self) -> int:
        return len(self.at)


def settled(at: Sequence[int], values: Sequence[float], rule: Rule, floor: float) -> Plateau | None:
    """The growth of ``values`` (at steps ``at``) if it stopped, by ``rule``; else None (it
    never grew, or it grows still, or it has not been flat long enough to tell). ``floor``:
    bytes per step of growth the series' noise and drift may show (the detector's)."""
    n = len(values)
    if n < rule.window + 4:
        return None
    smooth = _median3(values)  # a one-step spike neither ends nor starts a stretch
    b = _knot(at, smooth)  # where the growth's pace changed most: two lines fit best
    if b < 3 or n - b < 4:
        return None
    limit = max(rule.tolerance, floor)
    if not fit_growth(values[: b + 1], at[: b + 1]).exceeds(limit):
        return None
    # The steps right after it that still rose at the growth's pace belong to it, and so
    # does a later rise of at least ``flat_pace`` of all the growth (a staircase's last
    # block); a smaller one is the noise of a flat stretch.
    pace = (smooth[b] - smooth[0]) / max(at[b] - at[0], 1)
    while b + 1 < n and smooth[b + 1] - smooth[b] >= 0.5 * pace * (at[b + 1] - at[b]):
        b += 1
    step_up = rule.flat_pace * (statistics.median(smooth[-rule.window :]) - smooth[0])
    b = max([b, *(i for i in range(b + 1, n) if smooth[i] - smooth[i - 1] >= step_up)])
    if n - b < 4:
        return None
    took = at[b] - at[0]
    pace = (smooth[b] - smooth[0]) / max(took, 1)
    flat = at[-1] - at[b]
    rises = _rises(at[: b + 1], smooth[: b + 1], pace, 1)
    pause = max((at[j] - at[i] for i, j in itertools.pairwise(rises)), default=0)
    if flat < max(rule.window, rule.flat_share * (took + 1), rule.flat_pauses * pause):
        return None
    if fit_growth(values[b:], at[b:]).bytes_per_step > max(rule.flat_pace * pace, limit):
        return None
    last = [i for i, step in enumerate(at) if step > at[-1] - rule.window]
    if len(last) >= 4 and fit_growth([values[i] for i in last], [at[i] for i in last]).exceeds(
        limit
    ):
        return None
    return Plateau(smooth[b] - smooth[0], at[0], at[b], flat)


def _knot(at: Sequence[int], values: Sequence[float]) -> int:
    """The index that best splits ``values`` into two straight lines (least squares, each
    line its own): where a fill ends and a flat stretch starts."""
    n = len(values)
    xs, ys = [float(a) for a in at], [float(v) for v in values]
    sums = [[0.0] * (n + 1) for _ in range(5)]  # prefix sums of 1, x, y, xx, xy, yy
    for i, (x, y) in enumerate(zip(xs, ys)):
        for k, term in enumerate((x, y, x * x, x * y, y * y)):
            sums[k][i + 1] = sums[k][i] + term

    def sse(lo: int, hi: int) -> float:  # the residual of one line over [lo, hi)
        m = hi - lo
        sx, sy, sxx, sxy, syy = (s[hi] - s[lo] for s in sums)
        vxx, vxy, vyy = sxx - sx * sx / m, sxy - sx * sy / m, syy - sy * sy / m
        return vyy - (vxy * vxy / vxx if vxx > 0 else 0.0)

    best, knot = float("inf"), 0
    for b in range(3, n - 3):
        error = sse(0, b + 1) + sse(b + 1, n)
        if error < best:
            best, knot = error, b
    return knot


def _median3(values: Sequence[float]) -> list[float]:
    """Each value replaced by the median of it and its neighbours (the ends kept)."""
    out = [float(v) for v in values]
    for i in range(1, len(values) - 1):
        out[i] = statistics.median(values[i - 1 : i + 2])
    return out


def _rises(at: Sequence[int], values: Sequence[float], pace: float, start: int) -> list[int]:
    """The indices from ``start`` on where the series rose by at least half ``pace`` per
    step since the value before."""
    return [
        i
        for i in range(max(start, 1), len(values))
        if values[i] - values[i - 1] >= 0.5 * pace * (at[i] - at[i - 1])
    ]
