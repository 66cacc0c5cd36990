"""The watcher both framework callbacks share: the detector over one training run.

Lifetime contract
-----------------
*Kept*, by the :class:`GrowthWatch`, until :meth:`GrowthWatch.stop`: a
:class:`~leakfree.diagnostics.MemoryTracker` and, where the judged device has no allocator
statistics (the CPU), its storage tracker, active on the thread that called ``start``: it
holds a weak reference per storage created while active (and where it was created: two
code/line pairs), never the storage; ``torch.autograd.backward`` is wrapped while it runs
(:mod:`~leakfree.diagnostics.boundaries`). Also kept: the live bytes of the current window
of steps (at most ``window`` integers each for the heap and the storages), the two
searches of a suspicion in progress (paths and byte counts), the last
:class:`~leakfree.diagnostics.Growth`, the findings (names and byte counts, no tensors)
and the verdict; the whole run's series (:mod:`~leakfree.diagnostics.wholerun`) and the
optimizers stepped while it runs, weakly, through torch's optimizer step hook (removed at
``stop``). Of the objects handed to ``step`` as holders only the last callable is kept,
until ``stop``; they are walked only when something is found.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from leakfree.diagnostics import Growth, MemoryTracker, RetentionReport, fit_growth
from leakfree.diagnostics.detector import Finding, Rule, whole
from leakfree.diagnostics.memory import weak_method
from leakfree.diagnostics.roots import judged_device, named_roots
from leakfree.diagnostics.stores import ParameterState
from leakfree.errors import LeakError, LeakfreeWarning, MemoryGrowthWarning, NotJudgedWarning

#: the metric names both callbacks log (bytes; the growth is per optimizer step)
METRIC_LIVE = "leakfree/live_bytes"
METRIC_GROWTH = "leakfree/growth_bytes_per_step"

Holders = Callable[[], Mapping[str, Any]]


class GrowthWatch:
    """One training run watched by the detector: findings warned (or raised) as made.

    Args:
        owner: the callback's name, for messages (``LeakfreeCallback``).
        warmup: optimizer steps not judged across steps (optimizer state, allocator
            caches, lazy buffers appear there); retention per microbatch is judged from
            the first step.
        window: optimizer steps per across-step verdict (at least 4: the verdict asks
            both halves to grow), the most recent ones, judged at every step.
        tolerance: bytes per step of growth accepted beyond the noise bound.
        floor: bytes per step of growth accepted when no autograd graph holds it.
        fail: raise :class:`~leakfree.testing.LeakError` instead of warning.
        sample_every: on a device counted by the storage tracker (the CPU), track storages
            during about one optimizer step in this many, and every step while suspected
            growth is confirmed (see :class:`~leakfree.diagnostics.MemoryTracker`). An
            accelerator read from its allocator is read at every step regardless.
        device: the device judged (default: the accelerator if any, else the CPU).
        roots: extra objects to search for holders, ``{name: object}`` or an iterable
            (named ``root0``...), before the framework's objects, the stack and the user's
            module globals.

    Each holder is reported once per run (:mod:`leakfree.diagnostics.detector`).
    """

    def __init__(
        self,
        owner: str,
        *,
        warmup: int | None,
        window: int | None,
        tolerance: float | None,
        fail: bool,
        device: str | torch.device | None,
        roots: Mapping[str, Any] | Iterable[Any] | None,
        sample_every: int = 1,
        floor: float | None = None,
    ) -> None:
        # Everything is validated before anything is stored.
        self.rule = Rule.of(
            owner, "watching", warmup=warmup, window=window, tolerance=tolerance, floor=floor
        )
        self.sample_every = whole(owner, "sample_every", sample_every, 1)
        if not isinstance(fail, bool):
            raise TypeError(f"{owner}(fail={fail!r}): expected True or False")
        judged = judged_device(owner, device)
        named = named_roots(owner, roots)
        self.owner = owner
        self.fail = fail
        self.device = judged
        self.roots = named
        self.steps = 0  #: optimizer steps seen
        self.live: int | None = None  #: live bytes at the last step
        self.growth: Growth | None = None  #: the last window's growth
        self.retained: RetentionReport | None = None  #: the last finding's holders
        #: "leak", "clean" or "not judged" (the run ended first), as of the last ``stop``
        self.verdict = "not judged"
        self.judged_steps = 0  #: optimizer steps judged after the warm-up, as of ``stop``
        self.needed_steps = window  #: steps after the warm-up a verdict needs
        self.message: str | None = None  #: the first warning (or error) issued, if any
        #: what the run's end said of growth found during it (withdrawn or standing, why)
        self.revisions: list[str] = []
        self._findings: list[Finding] = []
        self._holders: Holders = dict
        self._tracker: MemoryTracker | None = None
        self._hook: Any = None  #: the optimizer step hook that sees the optimizers

    @property
    def active(self) -> bool:
        return self._tracker is not None

    @property
    def findings(self) -> list[Finding]:
        """The leaks found in this run (kept after ``stop``)."""
        return self._findings

    def start(self) -> None:
        """Start a run (idempotent while running): a new tracker, a new warm-up.

        Storages are tracked (a dispatch mode, on this thread) only when the judged device
        has no allocator statistics: on an accelerator the allocator's count is free.
        Backward passes are boundaries either way (microbatch retention).
        """
        if self._tracker is not None:
            return
        self.steps, self.live, self.growth = 0, None, None
        self.verdict, self.judged_steps = "not judged", 0
        self.retained, self.message, self._findings = None, None, []
        self.revisions = []
        tracker = MemoryTracker(
            devices=[self.device],
            sample_every=self.sample_every,
            rule=self.rule,
            roots=weak_method(self._roots),  # weakly: no cycle through the watch
            warn=False,
            on_finding=weak_method(self._finding),
            owner=self.owner,
            unit="optimizer steps",
        )
        tracker.__enter__()
        self._tracker = tracker
        # The optimizers' state, made lazily (layers unfrozen one by one), is told apart
        # from a leak at the run's end: the optimizers are seen at their steps, weakly.
        from torch.optim.optimizer import register_optimizer_step_post_hook

        params = ParameterState()
        tracker.detector.whole.parameter_state = params.bytes
        self._hook = register_optimizer_step_post_hook(lambda opt, *_: params.seen(opt))

    def stop(self, *, failed: bool = False) -> None:
        """End the run (idempotent): tracking stops; the numbers stay readable. A run too
        short to judge says so (:class:`~leakfree.integrations.NotJudgedWarning`), unless
        it ended by an error (``failed``): that says enough."""
        tracker, self._tracker = self._tracker, None
        if tracker is None:
            self._holders = dict
            return
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()
        detector = tracker.detector
        try:
            detector.finish()  # growth being confirmed: judged on what is in
        finally:
            self._holders = dict  # the framework's objects are not kept past the run
            tracker.__exit__(None, None, None)
        self.verdict = detector.verdict
        self.judged_steps, self.needed_steps = detector.judged_steps, detector.needed_steps
        self._revised(detector)
        if self.verdict == "not judged" and self.steps and not failed:
            # Said, never raised (fail=True raises on leaks): a short run is not a clean one.
            warnings.warn(
                f"{self.owner}: not judged: {detector.why_not_judged()}. No leak was found in "
                "them and none is ruled out; train longer, or lower warmup= or window=, for a "
                "verdict.",
                NotJudgedWarning,
                stacklevel=3,
            )

    def _revised(self, detector: Any) -> None:
        """The end's verdict over the whole run: growth warned of during it that stopped
        is withdrawn, and said so (:class:`~leakfree.LeakfreeWarning`); growth that did not
        stands, with why (:attr:`revisions`)."""
        kept = detector.findings
        withdrawn = [f for f in self._findings if f.kind == "growth" and f not in kept]
        self._findings = [f for f in self._findings if f not in withdrawn]
        self.revisions = detector.whole.said
        if withdrawn:
            self.retained = RetentionReport([h for f in self._findings for h in f.holders])
            for line in self.revisions:
                warnings.warn(f"{self.owner}: {line}", LeakfreeWarning, stacklevel=4)

    def _roots(self) -> dict[str, Any]:
        # Most specific first: a holder is named by the first root that reaches it.
        named = dict(self.roots)
        for name, value in self._holders().items():
            if value is not None and name not in named:
                named[name] = value
        return named

    def step(self, holders: Holders) -> None:
        """Record one optimizer step and judge the recent ones.

        ``holders`` returns ``{name: object}`` to search when something is found (called
        only then). Warns :class:`MemoryGrowthWarning`, or with ``fail`` stops the watch and
        raises :class:`~leakfree.testing.LeakError`.
        """
        tracker = self._tracker
        if tracker is None:
            return  # a step outside start/stop (e.g. the framework skipped train begin)
        self._holders = holders
        self.steps += 1
        live = tracker.step().get(str(self.device))
        if live is not None:
            self.live = live
        self.growth = tracker.detector.growth

    def _finding(self, finding: Finding) -> None:
        self._findings.append(finding)
        self.retained = RetentionReport(list(finding.holders))
        if self.message is None:
            self.message = finding.message
        if self.fail:
            growth = finding.growth or self.growth or fit_growth([])
            self.stop()
            raise LeakError(finding.message, growth, self.retained)
        warnings.warn(finding.message, MemoryGrowthWarning, stacklevel=5)

    def metrics(self) -> dict[str, float]:
        """The numbers to log: live bytes at the last step and, once a window was judged,
        its growth per step."""
        out: dict[str, float] = {}
        if self.live is not None:
            out[METRIC_LIVE] = float(self.live)
        if self.growth is not None:
            out[METRIC_GROWTH] = float(self.growth.bytes_per_step)
        return out


class WatchingCallback:
    """What both framework callbacks take and hold: their settings, validated once, and
    the :class:`GrowthWatch` built from them (``self.watch``). Each callback documents the
    arguments in its framework's words; the signature and the checks live only here.
    ``log``: report the numbers through the framework's logging (default True)."""

    def __init__(
        self,
        *,
        warmup: int | None = None,
        window: int | None = None,
        tolerance: float | None = None,
        fail: bool = False,
        floor: float | None = None,
        sample_every: int = 8,
        device: str | torch.device | None = None,
        roots: Mapping[str, Any] | Iterable[Any] | None = None,
        log: bool = True,
    ) -> None:
        owner = type(self).__name__
        if not isinstance(log, bool):
            raise TypeError(f"{owner}(log={log!r}): expected True or False")
        self.watch = GrowthWatch(
            owner,
            warmup=warmup,
            window=window,
            tolerance=tolerance,
            floor=floor,
            fail=fail,
            sample_every=sample_every,
            device=device,
            roots=roots,
        )
        self._log = log
        super().__init__()
