"""The run judged as a whole, when it ends: growth that stopped, and stores still filling.

A :class:`~leakfree.diagnostics.detector.Detector` judges a window of the last steps while
a run goes on; its findings of growth across steps are provisional (:data:`PROVISIONAL`).
:class:`WholeRun` keeps the whole run's series and, when the run ends, judges them:

* growth that stopped (:func:`~leakfree.diagnostics.plateau.settled`) is withdrawn:
  ``grew by X over steps a-b, then flat for n steps`` (:attr:`WholeRun.plateau`), when
  the exact storages sampled since do not grow either;
* growth still rising at the end stands, with why (a steady rise to the last step, or a
  slowing one without a long enough flat stretch), unless it is a store filling to its
  bound (:mod:`~leakfree.diagnostics.stores`): every holder bounded (a deque's maxlen, an
  lru_cache's maxsize, read when the finding was made, while its frame was alive), or the
  optimizers' state for more parameters making up half of it: then it is withdrawn and
  the run is not judged, for that reason (:attr:`WholeRun.ramp`).

Kept, for the run: three :class:`~leakfree.diagnostics.plateau.History` (at most 512 pairs
of integers each: the judged series, the exact values, the optimizers' state), the bounds
of holders found (text) and what the end said (text).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

from leakfree._text import format_bytes
from leakfree.diagnostics.findings import Finding, Tracked
from leakfree.diagnostics.growth import fit_growth
from leakfree.diagnostics.microbatch import HEAP_SLACK
from leakfree.diagnostics.plateau import History, Plateau, settled
from leakfree.diagnostics.retention import Retained
from leakfree.diagnostics.roots import frame_roots, module_roots
from leakfree.diagnostics.rule import Rule
from leakfree.diagnostics.stores import bound_of

__all__ = ["FILLED", "PROVISIONAL", "WholeRun"]

#: what a finding of growth across steps says of itself while the run goes on
PROVISIONAL = "provisional: judged again over the whole run when it ends"
#: what growth that stopped is, said at the run's end
FILLED = (
    "a store that filled (a bounded buffer or cache, optimizer state made as parameters "
    "first train), not a leak"
)


class WholeRun:
    """The whole run's series and the verdict on them at its end (see the module doc).

    ``tracker``: the detector's (the device it judges); ``roots``: the watcher's own, also
    searched for a holder's bound; ``unit``: what a step is, for messages."""

    def __init__(
        self,
        rule: Rule,
        tracker: Tracked,
        roots: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None,
        unit: str,
    ) -> None:
        self.rule = rule
        self.unit = unit
        self._tracker = tracker
        self._given = roots
        self.history = History()  #: the judged series (the heap's count, else exact)
        self.exact = History()  #: the exact (or allocator) values, where sampled
        self.state = History()  #: the optimizers' state, at every judged step
        self._noisy = False  #: the history is the heap's count
        #: the bytes of the optimizers' state and their parameters' gradients, if the
        #: watcher sees the optimizers (:class:`~leakfree.diagnostics.stores.ParameterState`)
        self.parameter_state: Callable[[], int] | None = None
        self.plateau: Plateau | None = None  #: growth that stopped, judged at the end
        #: what the end said of growth found during the run (withdrawn, or why it stands)
        self.revisions: list[str] = []
        self.ramp = ""  #: why growth still rising at the end is a store filling
        self._bounds: dict[str, str] = {}  #: the bounds of holders found (paths, text)
        self._finished = False

    @property
    def said(self) -> list[str]:
        """What the end said, for a report: the revisions, or a clean run's growth that
        stopped."""
        if self.plateau is not None and not self.revisions:
            return [f"{self.series} {self.plateau}: {FILLED}"]
        return list(self.revisions)

    def add(self, step: int, value: int, *, noisy: bool) -> None:
        """Step ``step`` was judged on ``value`` (the heap's count when ``noisy``)."""
        self.history.add(step, value)
        self._noisy = noisy
        if self.parameter_state is not None:
            self.state.add(step, self.parameter_state())

    def judge(self, findings: list[Finding]) -> None:
        """The run's verdict over all its steps (once): growth among ``findings`` (the
        detector's, changed in place) that stopped (a store that filled) is withdrawn,
        with why; growth to the end stands, with why, or is withdrawn as a store filling
        to its bound (:attr:`ramp`)."""
        if self._finished:
            return
        self._finished = True
        noise = max(self.rule.floor, HEAP_SLACK) if self._noisy else self.rule.floor
        history = self.history
        plateau = settled(history.at, history.values, self.rule, noise)
        if plateau is not None:
            # The exact values since the fill ended must not grow either: the heap's count
            # can hide a slow leak of tensors in its noise.
            exact = self.exact
            since = [i for i, step in enumerate(exact.at) if step >= plateau.last]
            at, values = [exact.at[i] for i in since], [exact.values[i] for i in since]
            limit = max(self.rule.tolerance, self.rule.floor)
            if len(since) >= 3 and fit_growth(values, at).exceeds(limit):
                plateau = None
        grown = [f for f in findings if f.kind == "growth"]
        self.plateau = plateau
        if plateau is None:
            for f in grown:
                ramp = self._bounded(f)
                if ramp:
                    findings.remove(f)
                    self.ramp = (
                        f"the growth reported at step {f.step} was still rising when the run "
                        f"ended, and {ramp}: a store filling, not a leak so far (a longer run "
                        "shows it flat)"
                    )
                    continue
                self.revisions.append(
                    f"the growth reported at step {f.step} stands at the run's end: "
                    f"{self._still(f)}"
                )
            return
        for f in grown:
            findings.remove(f)
            self.revisions.append(
                f"revised at the run's end, not a leak: the growth reported at step {f.step} "
                f"({format_bytes(f.bytes_per)}/step) stopped: {self.series} {plateau}: "
                f"{FILLED}"
            )

    @property
    def series(self) -> str:
        """What the run's history counts, for a report."""
        return "the C heap's count" if self._noisy else f"memory on {self._tracker.judged}"

    def _roots(self, frame: FrameType | None) -> dict[str, Any]:
        extra = self._given
        given = (extra() if callable(extra) else extra) or {}
        return {**module_roots(), **frame_roots(frame), **given}

    def note_bounds(self, holders: list[Retained], frame: FrameType | None) -> None:
        """The bounds of ``holders`` (a deque's maxlen...), read while the frame that may
        hold them is alive: the run's end judges growth still rising by them."""
        roots = self._roots(frame)
        for h in holders:
            bound = bound_of(h.where, roots)
            if bound:
                self._bounds[h.where] = bound

    def _bounded(self, finding: Finding) -> str:
        """Why ``finding``'s growth, still rising at the run's end, is a store filling to
        its bound ("" if it is not): each of its holders has a bound (a deque's maxlen, an
        lru_cache's maxsize), or the optimizers' state for their parameters grew by at least
        half of what memory did over its steps."""
        holders = finding.holders
        if holders:
            roots = self._roots(None)
            bounds = [self._bounds.get(h.where) or bound_of(h.where, roots) for h in holders]
            if all(bounds):
                return "it is held by bounded stores: " + "; ".join(
                    f"{h.where} ({b})" for h, b in zip(holders, bounds)
                )
        at, state, values = self.state.at, self.state.values, self.history.values
        if len(at) < 2 or len(at) != len(self.history.at):
            return ""
        since = next((i for i, step in enumerate(at) if step >= finding.step - self.rule.window), 0)
        made, grew = state[-1] - state[since], values[-1] - values[since]
        if made > 0 and made >= 0.5 * grew:
            return (
                f"the optimizers made state for more parameters over {self.unit} "
                f"{at[since]}-{at[-1]} (+{format_bytes(made)} with their gradients, of "
                f"{format_bytes(grew)}): bounded by the model's parameters"
            )
        return ""

    def _still(self, finding: Finding) -> str:
        """Why growth that did not stop by the run's end looks like a leak, or a ramp."""
        at, values = self.history.at, self.history.values
        after = [i for i, step in enumerate(at) if step >= finding.step - self.rule.window]
        if len(after) < 4:
            return "too few steps after it to tell whether it stops"
        growth = fit_growth([values[i] for i in after], [at[i] for i in after])
        first, second = growth.halves
        span = f"{self.unit} {at[after[0]]}-{at[-1]}"
        if growth.exceeds(self.rule.tolerance) and second >= 0.5 * first:
            return (
                f"{self.series} grew at a steady {growth} over {span}, to the last step, "
                "with no flat stretch: a leak (a store that fills stops; this one did not "
                "in the run)"
            )
        return (
            f"{self.series} slowed over {span} ({format_bytes(first)}/step, then "
            f"{format_bytes(second)}/step) but was not flat for long enough to be a store "
            "that filled: a ramp, or a leak; a longer run tells"
        )
