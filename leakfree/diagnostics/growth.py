"""How fast live bytes grow: a robust slope per step, with the bound noise could explain.

:func:`fit_growth` is the one fit every finder uses (the detector's verdicts, the
trackers' reports, the benchmarks); :class:`Growth` is its answer.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import leakfree._args as _args
from leakfree._text import format_bytes

__all__ = ["Growth", "fit_growth"]


@dataclass(frozen=True)
class Growth:
    """Least-squares growth of live bytes per step."""

    bytes_per_step: float
    noise: float  #: bound on what noise alone could produce (bytes per step)
    steps: int  #: samples used
    first: int  #: live bytes at the first sample used
    last: int  #: live bytes at the last sample
    halves: tuple[float, float] = (0.0, 0.0)  #: slopes over the first and the second half

    def exceeds(self, tolerance: float = 0.0) -> bool:
        """Growth beyond ``tolerance`` bytes per step that noise cannot explain, and that
        persists: both halves of the run grow too (a one-off jump, e.g. optimizer state
        created mid-run, is not a leak)."""
        return self.bytes_per_step - self.noise > tolerance and min(self.halves) > tolerance

    def __str__(self) -> str:
        return f"{format_bytes(self.bytes_per_step)}/step +- {format_bytes(self.noise)}"


#: fit_growth reads at most this many points (evenly spaced) of a longer series
_MAX_POINTS = 128


def fit_growth(values: Sequence[float], at: Sequence[int] | None = None) -> Growth:
    """Slope of ``values`` against their step (``at``: each value's; by default its index),
    with a noise bound.

    The slope is the Theil-Sen estimate (the median of the slopes between every pair of
    points), so a bounded jump (a cache filled over the first steps, optimizer state
    created on the first step) moves it no more than a few points of noise would: a steady
    4 B per step is still 4 B per step after a 1 MiB fill. The noise bound is three
    standard errors of the slope, from the median absolute residual (robust too); a series
    with no noise at all gets a bound of 0, so any steady growth counts.
    """
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise _args.refuse("fit_growth", "values", values, "a sequence of numbers")
    n = len(values)
    if at is not None and (not isinstance(at, Sequence) or len(at) != n):
        raise _args.refuse("fit_growth", "at", at, f"None or a sequence of {n} steps")
    if n < 2:
        v = int(values[0]) if values else 0
        return Growth(0.0, math.inf, n, v, v)
    points = list(values)
    if n > _MAX_POINTS:  # evenly spaced, both ends kept: a linear series stays exact
        stride = (n - 1) / (_MAX_POINTS - 1)
        xs = [round(i * stride) for i in range(_MAX_POINTS)]
    else:
        xs = list(range(n))
    ys = [float(points[x]) for x in xs]
    if at is not None:
        xs = [at[x] for x in xs]
    slope = _theil_sen(xs, ys)
    intercept = statistics.median(y - slope * x for x, y in zip(xs, ys))
    residuals = [y - intercept - slope * x for x, y in zip(xs, ys)]
    noise = 0.0
    if len(xs) > 2:
        sigma = 1.4826 * statistics.median(abs(r) for r in residuals)
        mean_x = sum(xs) / len(xs)
        sxx = sum((x - mean_x) ** 2 for x in xs)
        noise = 3 * sigma / math.sqrt(sxx)
    half = len(xs) // 2
    if len(xs) >= 4:
        halves = (
            _theil_sen(xs[: half + 1], ys[: half + 1]),
            _theil_sen(xs[half:], ys[half:]),
        )
    else:
        halves = (slope, slope)
    return Growth(slope, noise, n, int(values[0]), int(values[-1]), halves)


def _theil_sen(xs: Sequence[int], ys: Sequence[float]) -> float:
    return statistics.median(
        (ys[j] - ys[i]) / (xs[j] - xs[i])
        for i in range(len(xs))
        for j in range(i + 1, len(xs))
        if xs[j] != xs[i]
    )
