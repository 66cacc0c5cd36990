"""The watcher both framework callbacks share: sample, judge growth, name the holders.

Lifetime contract
-----------------
*Kept*, by the :class:`GrowthWatch`, until :meth:`GrowthWatch.stop`: a
:class:`~leakfree.diagnostics.MemoryTracker` and, where the judged device has no allocator
statistics (the CPU), its storage tracker, active on the thread that called ``start``: it
holds a weak reference per storage created while active, never the storage. Also kept: the
live bytes of the current window of steps (at most ``window`` integers), the last
:class:`~leakfree.diagnostics.Growth` and, after a growth verdict, the retention report
(names and byte counts, no tensors). Nothing is kept of the objects handed to ``step`` as
holders: they are walked only when growth is found, and let go at once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from leakfree._device import accelerator, device_module
from leakfree._text import format_bytes
from leakfree.diagnostics import Growth, MemoryTracker, RetentionReport, find_retained, fit_growth
from leakfree.integrations import MemoryGrowthWarning
from leakfree.testing import LeakError

__all__ = ["METRIC_GROWTH", "METRIC_LIVE", "GrowthWatch"]

#: the metric names both callbacks log (bytes; the growth is per optimizer step)
METRIC_LIVE = "leakfree/live_bytes"
METRIC_GROWTH = "leakfree/growth_bytes_per_step"

Holders = Callable[[], Mapping[str, Any]]


def _whole(owner: str, name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{owner}({name}={value!r}): expected an int >= {least}")
    return value


class GrowthWatch:
    """Live bytes after each optimizer step; a growth verdict per window after a warm-up.

    Args:
        owner: the callback's name, for messages (``LeakfreeCallback``).
        warmup: optimizer steps not judged (optimizer state, allocator caches, lazy
            buffers appear there).
        window: steps per verdict (at least 4: the verdict asks both halves to grow).
            Each window is judged on its own, so the cost per step stays constant.
        tolerance: bytes per step of growth accepted beyond the noise bound.
        fail: raise :class:`~leakfree.testing.LeakError` instead of warning.
        sample_every: on a device counted by the storage tracker (the CPU), track storages
            during about one optimizer step in this many (see
            :class:`~leakfree.diagnostics.MemoryTracker`); ``window`` then counts tracked
            steps. An accelerator read from its allocator is read at every step regardless.
        device: the device judged (default: the accelerator if any, else the CPU).
        roots: extra objects for :func:`~leakfree.diagnostics.find_retained` to search,
            ``{name: object}`` or an iterable (named ``root0``...).

    Warns (or raises) once per run: the first window that grows.
    """

    def __init__(
        self,
        owner: str,
        *,
        warmup: int,
        window: int,
        tolerance: float,
        fail: bool,
        device: str | torch.device | None,
        roots: Mapping[str, Any] | Iterable[Any] | None,
        sample_every: int = 1,
    ) -> None:
        # Everything is validated before anything is stored.
        self.warmup = _whole(owner, "warmup", warmup, 0)
        self.window = _whole(owner, "window", window, 4)
        self.sample_every = _whole(owner, "sample_every", sample_every, 1)
        if (
            isinstance(tolerance, bool)
            or not isinstance(tolerance, (int, float))
            or not tolerance >= 0
            or tolerance == float("inf")
        ):
            raise ValueError(
                f"{owner}(tolerance={tolerance!r}): expected a finite number of bytes per step >= 0"
            )
        if not isinstance(fail, bool):
            raise TypeError(f"{owner}(fail={fail!r}): expected True or False")
        if device is None:
            judged = accelerator() or torch.device("cpu")
        else:
            try:
                judged = torch.device(device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"{owner}(device={device!r}): not a device ({e})") from None
        if roots is None:
            named: dict[str, Any] = {}
        elif isinstance(roots, Mapping):
            named = dict(roots)
            bad = [k for k in named if not isinstance(k, str)]
            if bad:
                raise TypeError(f"{owner}(roots=...): names must be strings, got {bad[0]!r}")
        elif isinstance(roots, (str, bytes)) or not isinstance(roots, Iterable):
            raise TypeError(
                f"{owner}(roots={roots!r}): expected {{name: object}} or a list of objects "
                "to search for holders"
            )
        else:
            named = {f"root{i}": r for i, r in enumerate(roots)}
        self.owner = owner
        self.tolerance = float(tolerance)
        self.fail = fail
        self.device = judged
        self.roots = named
        self.steps = 0  #: optimizer steps seen
        self.live: int | None = None  #: live bytes at the last step
        self.growth: Growth | None = None  #: the last window's growth
        self.retained: RetentionReport | None = None  #: what find_retained found, on growth
        self.message: str | None = None  #: the warning (or error) issued, if any
        self._values: list[int] = []
        self._at: list[int] = []  #: the optimizer step of each value in the window
        self._tracker: MemoryTracker | None = None
        self._tracking = False

    @property
    def active(self) -> bool:
        return self._tracker is not None

    def start(self) -> None:
        """Start a run (idempotent while running): a new tracker, a new warm-up.

        Storages are tracked (a dispatch mode, on this thread) only when the judged device
        has no allocator statistics: on an accelerator the allocator's count is free.
        """
        if self._tracker is not None:
            return
        self.steps, self.live, self.growth = 0, None, None
        self.retained, self.message, self._values, self._at = None, None, [], []
        tracker = MemoryTracker(devices=[self.device], sample_every=self.sample_every)
        module = device_module(self.device) if self.device.type != "cpu" else None
        self._tracking = getattr(module, "memory_allocated", None) is None
        if self._tracking:
            tracker.__enter__()
        self._tracker = tracker

    def stop(self) -> None:
        """End the run (idempotent): storage tracking stops; the numbers stay readable."""
        tracker, self._tracker = self._tracker, None
        if tracker is not None and self._tracking:
            self._tracking = False
            tracker.__exit__(None, None, None)

    def step(self, holders: Holders) -> None:
        """Record one optimizer step; at the end of a window, judge it.

        ``holders`` returns ``{name: object}`` to search when a window grows (called only
        then). Warns :class:`MemoryGrowthWarning`, or with ``fail`` stops the watch and
        raises :class:`~leakfree.testing.LeakError`.
        """
        tracker = self._tracker
        if tracker is None:
            return  # a step outside start/stop (e.g. the framework skipped train begin)
        self.steps += 1
        live = tracker.step().get(str(self.device))
        if live is None:
            return  # a step the sampling tracker did not track
        self.live = live
        if self.steps <= self.warmup:
            return
        self._values.append(live)
        self._at.append(self.steps)
        if len(self._values) < self.window:
            return
        values, at = self._values, self._at
        self._values, self._at = [live], [self.steps]  # windows share their end points
        growth = fit_growth(values)
        self.growth = growth
        if self.message is None and growth.exceeds(self.tolerance):
            self._verdict(growth, holders, at[0])

    def _verdict(self, growth: Growth, holders: Holders, first: int) -> None:
        # Most specific first: a holder is named by the first root that reaches it.
        named = dict(self.roots)
        for name, value in holders().items():
            if value is not None and name not in named:
                named[name] = value
        retained = find_retained(*named.values(), names=list(named))
        self.retained = retained
        last = self.steps
        sampled = f", {growth.steps} of them tracked," if last - first + 1 > growth.steps else ""
        self.message = (
            f"{self.owner}: live memory on {self.device} grew by {growth} over optimizer "
            f"steps {first}-{last} ({last - first + 1} steps{sampled} after a "
            f"{self.warmup}-step warm-up; "
            f"{format_bytes(growth.first)} -> {format_bytes(growth.last)}).\n"
            f"Who holds it (find_retained over {', '.join(named)}):\n{retained}"
        )
        if self.fail:
            self.stop()
            raise LeakError(self.message, growth, retained)
        warnings.warn(self.message, MemoryGrowthWarning, stacklevel=3)  # the callback hook

    def metrics(self) -> dict[str, float]:
        """The numbers to log: live bytes at the last step and, once a window was judged,
        its growth per step."""
        out: dict[str, float] = {}
        if self.live is not None:
            out[METRIC_LIVE] = float(self.live)
        if self.growth is not None:
            out[METRIC_GROWTH] = float(self.growth.bytes_per_step)
        return out
