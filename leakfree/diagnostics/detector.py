"""The detector's rule: when live bytes are a leak, and who is told what holds them.

A :class:`Detector` reads the live bytes a :class:`~leakfree.diagnostics.MemoryTracker`
samples at two boundaries and turns them into :class:`Finding` s, and a run into a
verdict with three values: ``"leak"``, ``"clean"`` (``window`` steps after the warm-up
judged, nothing found) and ``"not judged"`` (the run ended first, or while growth was
being confirmed). A short run is never called clean.

**Within a step** (after every backward pass, see
:mod:`~leakfree.diagnostics.boundaries`): when the bytes alive after a backward exceed those
after the one before, the holders are searched (the locals of the frames on the stack, the
user's module globals, the watcher's roots). Backpropagated graphs from several
microbatches in one holder (``output_lst[*]['entropy']``), each keeping more than
``graph_floor`` bytes through its graph (saved tensors, ctx state, leaves: what detaching would
free), are a finding at once, in the first step. So is any tensor a holder gained on every
backward pass since a baseline search (outputs, logits, losses, with a graph or without),
each worth more than :data:`~leakfree.diagnostics.microbatch.MICRO_FRACTION` of what a
microbatch allocates, once it falls back when the step ends: memory that builds up per
microbatch and comes back at the step's end never shows as growth between steps. Detached
scalars kept until the step ends (a loss history), the step's own inputs and a cache that
stays are no finding.

**Across steps** (at every ``step()`` after ``warmup`` steps), in three moves:

1. *suspect*: the series read at every step (an allocator's count; on the CPU the C
   heap's, :mod:`~leakfree.diagnostics.heap`, or the storages' when every step is
   tracked) grows over the last ``window`` steps, from four of them on
   (:func:`~leakfree.diagnostics.fit_growth`: beyond its noise bound and ``tolerance``, in
   both halves; the heap beyond :data:`~leakfree.diagnostics.microbatch.HEAP_SLACK` and its
   drift so far). The holders are searched: the baseline;
2. *confirm*: the tracker follows every step exactly (:attr:`Detector.confirming`) for
   :data:`CONFIRM` steps (two when every step was exact already), then fits the exact
   values;
3. *name what grew*: the holders are searched again and only those whose own bytes or
   count grew since the baseline are named (a constant retained graph elsewhere is not the
   holder of another's growth):

* growth that holds autograd graphs (a backpropagated graph in a growable container, a
  graph kept by ``retain_graph=True``, ctx state kept after backward) is a finding
  whatever its size: a loss with its graph kept every step is 4 B per step; so is a graph
  in a name or an attribute that grew by about what memory did;
* tensors held only by reference cycles: a finding that says whether gc is disabled, how
  many bytes ``gc.collect()`` would free and the cycle's path
  (:mod:`~leakfree.diagnostics.cycles`);
* any other growth (detached tensors in a container, a holder not found) is a finding
  above ``floor`` bytes per step (64 by default: a loss history of a few scalars per
  step is not a leak);
* heap growth with no storage growth, where a graph gained autograd nodes on every step:
  a running total chained through its graph (``total += loss``). Heap growth with neither
  is the program's own drift: the heap is suspected again only above twice its rate.

**At the run's end** (:meth:`Detector.finish`) the whole run is judged: the judged series
of every step, by the plateau rule (:mod:`~leakfree.diagnostics.wholerun`, the detector's
``whole``). Growth found during the run (each such finding says it is provisional) that then stopped
is withdrawn: ``grew by X over steps a-b, then flat for n steps``; growth still rising at
the end stands, with why, unless it is a store filling to its bound: then the run is not
judged, with that reason.

Once, at the first step after the warm-up, with automatic collection on: tensors made
during the run (on an allocator-read device: tensors on that device) that sit in
reference cycles are reported as freed late. That probe is one full collection (0.1-0.2 s
with transformers imported), once per run.

Searches cost milliseconds, and each walks every graph a leak keeps: one that finds
nothing backs off (it waits twice as many steps before the next), every confirmation
backs off, found or not, and growth at the pace of a leak already reported starts no
search, so a growing leak costs a few searches per run. Each holder is reported once per
run, by its path or by the line that made what it holds.

Kept, by the detector, for its run: a window of integers per series, the whole run's
judged series (at most 512 pairs of integers each, for the series, the exact values and
the optimizers' state), the two searches' reports of a suspicion in progress (paths and
byte counts, no tensors), the bounds of holders found (text), and the findings.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

import torch

from leakfree._text import format_bytes
from leakfree.diagnostics.cycles import find_cycles
from leakfree.diagnostics.findings import Finding, Reporter, Tracked
from leakfree.diagnostics.growth import Growth, fit_growth
from leakfree.diagnostics.microbatch import HEAP_SLACK, PerMicrobatch
from leakfree.diagnostics.retention import (
    Retained,
    RetentionReport,
    by_holder,
    group,
    holder_key,
)
from leakfree.diagnostics.rule import CONTEXTS, DEFAULT_FLOOR, Rule, whole
from leakfree.diagnostics.wholerun import PROVISIONAL, WholeRun

__all__ = ["CONTEXTS", "DEFAULT_FLOOR", "Detector", "Finding", "Rule", "whole"]


#: steps of exact (or allocator) values a suspicion is confirmed over
CONFIRM = 4


class Detector:
    """Judges one tracker's samples by a :class:`Rule`; see the module doc.

    ``roots`` (``{name: object}``, or a callable returning one, called only when
    searching) are searched before module globals and stack frames; ``on_finding`` is
    called with each new :class:`Finding` (a watcher warns or raises there); ``owner``
    names the watcher in messages, ``unit`` what a step is ("optimizer steps").

    The detector judges across steps itself and holds two parts: what builds up within a
    step (:class:`~leakfree.diagnostics.microbatch.PerMicrobatch`) and the reporter that
    searches for holders and makes findings
    (:class:`~leakfree.diagnostics.findings.Reporter`).
    """

    def __init__(
        self,
        tracker: Tracked,
        *,
        owner: str = "MemoryTracker",
        rule: Rule | None = None,
        roots: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
        on_finding: Callable[[Finding], None] | None = None,
        unit: str = "steps",
    ) -> None:
        self.rule = Rule() if rule is None else rule
        self.rule.check(owner)
        self.tracker = tracker
        self.unit = unit
        self.reporter = Reporter(tracker, owner=owner, roots=roots, on_finding=on_finding)
        self._micro = PerMicrobatch(self.reporter, self.rule)
        self.steps = 0  #: step boundaries seen
        self.judged_steps = 0  #: steps after the warm-up with a measure (the verdict's basis)
        self.growth: Growth | None = None  #: the last across-step verdict's growth
        self._heap_floor = float(HEAP_SLACK)  #: heap growth per step not suspected
        self._explained = 0.0  #: exact growth per step already reported
        self._signal: list[int] = []  #: the cheap measure per step, the last window
        self._values: list[int] = []  #: exact live bytes per tracked step, the last window
        self._at: list[int] = []  #: the step of each value
        self._confirm: list[int] | None = None  #: exact values since a suspicion, if one
        self._base: RetentionReport | None = None  #: the holders when growth was suspected
        self._suspected_at = 0
        self._judged_before = 0  #: steps judged before the suspicion in progress
        self._heap_growth: Growth | None = None  #: the heap's growth that was suspected
        self._next_search = 0  #: the step from which growth may be suspected again
        self._backoff = 1
        self._probed = False
        #: the run judged as a whole when it ends (growth that stopped, stores filling)
        self.whole = WholeRun(self.rule, tracker, roots, unit)
        #: findings across steps say they are provisional (judged again at the run's end);
        #: a check that stops at its first finding (``assert_no_leak``) sets it False
        self.provisional = True

    @property
    def owner(self) -> str:
        return self.reporter.owner

    @property
    def findings(self) -> list[Finding]:
        """The leaks found so far."""
        return self.reporter.findings

    def guard(self, call: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """``call(*args, **kwargs)``, never raising an error of leakfree's own into the
        training step (:meth:`Reporter.guard`)."""
        self.reporter.guard(call, *args, **kwargs)

    def backward(
        self, live: int, frame: FrameType | None, *, made: int | None = None, noisy: bool = False
    ) -> None:
        """A backward pass ended with ``live`` bytes alive (called by the tracker; see
        :meth:`PerMicrobatch.backward`)."""
        explained = self._heap_floor if noisy else 2 * self._explained
        self._micro.backward(
            live, frame, steps=self.steps, explained=explained, made=made, noisy=noisy
        )

    # -- the verdict -----------------------------------------------------------------

    @property
    def needed_steps(self) -> int:
        """Steps after the warm-up a run must have measured before it can be called clean."""
        return self.rule.window

    @property
    def confirming(self) -> bool:
        """Growth is suspected and being confirmed: the tracker follows every step exactly."""
        return self._confirm is not None

    @property
    def verdict(self) -> str:
        """``"leak"`` (a finding), ``"clean"`` (judged over enough steps, nothing found) or
        ``"not judged"`` (the run ended first, or while growth was being confirmed)."""
        if self.findings:
            return "leak"
        if self.whole.ramp:
            return "not judged"
        # A suspicion the run ended too soon to confirm leaves the steps judged before it.
        judged = self.judged_steps if self._confirm is None else self._judged_before
        return "clean" if judged >= self.needed_steps else "not judged"

    def why_not_judged(self) -> str:
        """What kept a run from a verdict, for the report (empty once judged)."""
        if self.verdict != "not judged":
            return ""
        if self.whole.ramp:
            return self.whole.ramp
        if self._confirm is not None:
            return (
                f"{self._judged_before} of the {self.needed_steps} {self.unit} a verdict "
                f"needs were judged before growth suspected at step {self._suspected_at}, "
                "which the run ended too soon to confirm"
            )
        return (
            f"{self.judged_steps} of the {self.needed_steps} {self.unit} a verdict needs "
            f"were judged (the run had {self.steps}; a verdict needs "
            f"{self.rule.warmup + self.needed_steps}: a {self.rule.warmup}-step warm-up, "
            f"then {self.needed_steps})"
        )

    # -- boundaries ------------------------------------------------------------------

    def step(self, live: int | None, frame: FrameType | None, signal: int | None = None) -> None:
        """A step ended with ``live`` exact (or allocator) bytes alive (None: not sampled)
        and ``signal`` bytes by a cheap measure read at every step (the C heap), if any."""
        self._micro.step_ended(frame, self.steps)
        self.steps += 1
        if self.steps <= self.rule.warmup:
            return
        if not self._probed and gc.isenabled():  # at the first step after the warm-up,
            self._probed = True  # tracked or not: a one-off cost at a known place
            self._cycles()
        primary = signal if signal is not None else live
        if primary is not None:
            self.judged_steps += 1
            self.whole.add(self.steps, primary, noisy=signal is not None)
        if live is not None:
            self.whole.exact.add(self.steps, live)
            self._values.append(live)
            self._at.append(self.steps)
            del self._values[: -self.rule.window], self._at[: -self.rule.window]
        if self._confirm is not None:
            if live is not None:
                self._confirm.append(live)
            # Exact values every step need only a later search to see what grew; a heap's
            # suspicion needs exact values to confirm it.
            if len(self._confirm) >= (CONFIRM if signal is not None else 2):
                self._conclude(frame)
            return
        if self.steps < self._next_search:
            return
        if signal is not None:
            # Judged at every step from four of them on: a heap that grows steadily, beyond
            # its noise and its drift, is suspected; the storages then say what grew.
            self._signal.append(signal)
            del self._signal[: -self.rule.window]
            if len(self._signal) >= 4:
                heap = fit_growth(self._signal)
                if heap.exceeds(max(self.rule.tolerance, self._heap_floor)):
                    self._suspect(frame, heap)
                    return
            # The sampled exact series still judges what the heap's noise hides.
            if len(self._values) >= self.rule.window:
                self.judge(frame)
        elif live is not None and len(self._values) >= 4:
            self.judge(frame)

    def judge(self, frame: FrameType | None = None) -> None:
        """Judge the recent exact values now: growth noise cannot explain is suspected and
        confirmed over the next steps (see :meth:`step`)."""
        if len(self._values) < 4:
            return
        growth = fit_growth(self._values)
        self.growth = growth
        if self.steps < self._next_search:
            return
        if growth.exceeds(max(self.rule.tolerance, 2 * self._explained)):
            self._suspect(frame)

    def _suspect(self, frame: FrameType | None, heap: Growth | None = None) -> None:
        """Growth is suspected: note who holds what now, and follow the next
        :data:`CONFIRM` steps exactly (the tracker reads :attr:`confirming`)."""
        self._heap_growth = heap
        self._judged_before = self.judged_steps - 1  # the suspicious one is not
        self._suspected_at = self.steps
        self._confirm = []
        self._base = self.reporter.search(frame, everything=True)

    def _conclude(self, frame: FrameType | None) -> None:
        """The confirmation's steps are in: a finding if they grew, then back off either
        way, so a leak that keeps growing is searched a few times per run, not per step."""
        confirm, self._confirm = self._confirm or [], None
        base, self._base = self._base, None
        heap, self._heap_growth = self._heap_growth, None
        # A heap's suspicion is judged on the steps followed since: the window may hold
        # steps from before a leak began, and a fit over both would call it a one-off.
        values = confirm if heap is not None and len(confirm) >= 2 else self._values
        growth = fit_growth(values)
        self.growth = growth
        if growth.exceeds(max(self.rule.tolerance, 2 * self._explained)):
            # Reported, or judged no leak (a metric history under the floor): growth at
            # that pace is not searched again (each search walks every graph a leak
            # keeps); a faster one still is.
            self._across(growth, frame, base)
            self._explained = max(self._explained, growth.bytes_per_step)
        elif heap is not None:
            self._chained(heap, frame, base)
        if heap is not None:
            # What the heap grew by is accounted for: a leak just reported, a metric
            # history under the floor, or Python's and the libraries' own drift. Suspect
            # it again only above twice that.
            self._heap_floor = max(self._heap_floor, 2 * heap.bytes_per_step)
        self._judged_before = self.judged_steps
        self._next_search = self.steps + self._backoff
        self._backoff *= 2

    def _provisional(self, before: str, after: str) -> str:
        """What a finding across steps says of itself: provisional where the run is judged
        again as a whole when it ends (not in a check that stops at its first finding)."""
        return f"{before}{PROVISIONAL}{after}" if self.provisional else ""

    def _chained(self, heap: Growth, frame: FrameType | None, base: RetentionReport | None) -> None:
        """The heap grew and no tensor storage did: is it autograd nodes, a graph chained
        to the next step's (``total_loss += loss`` after ``loss.backward()``)? Then its
        holder, whose graph gained nodes on every step since the suspicion, is a finding."""
        if base is None:
            return
        steps = max(self.steps - self._suspected_at, 1)
        before = by_holder(base.items)
        report = self.reporter.search(frame, everything=True)
        gained: dict[tuple[str, str], float] = {}  #: autograd nodes per step, by holder
        chains = []
        for held in group([i for i in report.items if i.kind == "graph"]):
            was = before.get(holder_key(held))
            if was is not None and held.nodes - was.nodes >= steps:
                chains.append(held)
                gained[holder_key(held)] = (held.nodes - was.nodes) / steps
        if not chains:
            return
        self.reporter.found(
            "growth",
            chains,
            heap.bytes_per_step,
            f"{self.owner}: host memory grows by {heap} on the heap over {self.unit} "
            f"{self._suspected_at - len(self._signal) + 1}-{self.steps}"
            f"{self._provisional(' (', ')')}, and no tensor storage does: autograd graphs "
            "grow step after step, each chained to the last "
            "(a running total of losses with their graphs, ``total += loss``): keep "
            "``loss.detach()`` or ``loss.item()`` instead. Held by:",
            step=self.steps,
            growth=heap,
            note=lambda h: f", +{gained[holder_key(h)]:.0f} autograd nodes per step",
        )

    def finish(self, frame: FrameType | None = None) -> None:
        """The run ended: holders pending since the last step are looked at once more, and
        growth being confirmed is judged over the exact values there are (two since the
        suspicion, or four in the window), else the verdict rests on the steps judged
        before it."""
        self._micro.finish(frame, self.steps)
        if self._confirm is not None and (len(self._confirm) >= 2 or len(self._values) >= 4):
            if not self._confirm:  # no step since the suspicion: what grew is unknown
                self._base = None
            self._conclude(frame)
        self.whole.judge(self.findings)

    # -- verdicts --------------------------------------------------------------------

    def _across(
        self, growth: Growth, frame: FrameType | None, base: RetentionReport | None
    ) -> None:
        # One search: what a report lists by default (graphs in growable containers or
        # kept by retain_graph=True, ctx state), and what a clean loop holds too.
        found = self.reporter.found
        full = self.reporter.search(frame, since=base, everything=True)
        # Only what grew since the suspicion is named: a constant retained graph elsewhere
        # (last step's loss kept with retain_graph=True) is not the holder of this growth.
        before = base.items if base is not None else None
        grown = _grew([i for i in full.items if i.listed], before)
        graphs = [i for i in grown if i.kind == "graph"]
        pinned = [i for i in grown if i.kind == "ctx attribute"]
        detached = _grew(full.all_detached, base.all_detached) if base is not None else []
        if not graphs and base is not None:
            # A graph held where a clean loop holds one too (a name, an attribute) is the
            # holder only if it grew by about what memory did and gained autograd nodes on
            # every step: one graph chained to the next (``val_loss += loss`` outside
            # no_grad), not a local rebound to a bigger output every step.
            steps = max(self.steps - self._suspected_at, 1)
            at_least = 0.5 * growth.bytes_per_step * steps
            old = by_holder(base.items)
            graphs = [
                i
                for i in _grew(full.items, before, at_least)
                if i.kind == "graph" and i.nodes - _nodes(old.get(holder_key(i))) >= steps
            ]
        items = graphs + pinned + (detached if graphs or pinned else [])
        lead = self._lead(growth)
        per, step = growth.bytes_per_step, self.steps
        if items:
            self.whole.note_bounds(items, frame)
            found("growth", items, per, f"{lead}, held by:", step=step, growth=growth)
            return
        under = per <= max(self.rule.floor, self.rule.tolerance)
        # The probe is a full collection: with gc on, cycles are freed late, not kept, and
        # growth under the floor is not worth one.
        if not (under and gc.isenabled()) and self._cycles(growth):
            return
        if under:
            return  # a few detached scalars per step: a metric history, not a leak
        seen = detached
        if not seen:  # what a clean loop holds too: graphs before backward, detached tensors
            every = [i for i in full.items if i.kind == "graph"] + full.all_detached
            before = (base.items + base.all_detached) if base is not None else None
            seen = _grew(every, before)
        if seen:
            self.whole.note_bounds(seen, frame)
            found(
                "growth",
                seen,
                per,
                f"{lead}; no backpropagated graph holds it. What holds tensors (graphs not "
                "backpropagated, tensors without a graph):",
                step=step,
                growth=growth,
            )
            return
        made = ""
        storages = self.tracker.storage_tracker
        if storages is not None:  # no holder: at least the lines that made what grew
            grown = storages.alive_by_site(self.rule.warmup)  # epoch k-1: made in step k
            made = "".join(
                f"\n  created at {site}: {count} storage(s), {format_bytes(nbytes)}"
                for site, count, nbytes in grown[:5]
            )
        found(
            "growth",
            [],
            per,
            f"{lead}; no holder found among the module globals, the stack and the roots "
            "given: it is held where a walk cannot see (C++: hooks on graph nodes, an "
            "extension's objects) or by an object you can pass as roots=...; what grew "
            f"after the warm-up, by the line that made it:{made or ' unknown'}",
            step=step,
            growth=growth,
        )

    def _lead(self, growth: Growth) -> str:
        """A growth finding's first words: how much, where, over which steps."""
        first = self._at[-growth.steps] if len(self._at) >= growth.steps else 1
        span = self.steps - first + 1
        sampled = f", {growth.steps} of them tracked" if span > growth.steps else ""
        return (
            f"{self.owner}: memory grows by {growth} on {self.tracker.judged} over "
            f"{self.unit} {first}-{self.steps} ({span} steps after a {self.rule.warmup}-step "
            f"warm-up{sampled}; {format_bytes(growth.first)} -> {format_bytes(growth.last)}"
            f"{self._provisional('; ', '')})"
        )

    def _cycles(self, growth: Growth | None = None) -> bool:
        """Tensors held only by reference cycles, made while watching: reported once (or
        already); whether there are any."""
        storages = self.tracker.storage_tracker
        try:
            if storages is not None:  # only tensors made while watching are charged to it
                cycles = find_cycles(site=storages.site, mine=storages.tracks)
            else:  # an allocator's count: the tensors on the judged device
                judged = torch.device(self.tracker.judged)
                cycles = find_cycles(mine=lambda t: t.device == judged)
        except Exception as e:  # never break a training step on a bug of ours
            self.reporter.failed(e)
            return False
        if cycles is None:
            return False
        kind = "late cycles" if cycles.gc_enabled else "cycles"
        if not self.reporter.once((kind, "")):
            return True
        finding = Finding(
            kind,
            f"{self.owner}: {cycles} (step {self.steps}). Break the cycle (a weak "
            "reference, or del the attribute at the step's end) or call gc.collect() "
            "every step.",
            float(cycles.nbytes),
            self.steps,
            cycles=cycles,
            growth=growth,
        )
        self.reporter.emit(finding)
        return True


def _nodes(item: Retained | None) -> int:
    return item.nodes if item is not None else 0


def _grew(
    now: list[Retained], before: list[Retained] | None, at_least: float = 0.0
) -> list[Retained]:
    """The holders of ``now`` (grouped) that are new or hold more than in ``before`` (by
    more than ``at_least`` bytes, when given): what grew, not what merely stayed alive.
    All of ``now`` without a ``before``."""
    if before is None:
        return now
    old = by_holder(before)
    out = []
    for h in group(now):
        was = old.get(holder_key(h))
        more = h.nbytes - (was.nbytes if was is not None else 0)
        if at_least:
            if more >= at_least:
                out.append(h)
        elif was is None or max(h.count, 1) > max(was.count, 1) or more > 0:
            out.append(h)
    return out
