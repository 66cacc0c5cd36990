"""Within a step: memory that builds up per microbatch (per backward pass).

After every backward the bytes alive are compared with those after the one before; a
holder that gained a graph, or a tensor, on every pass is searched for, and a finding is
made at once for graphs kept from several microbatches, or when the step ends for what
then falls back. :class:`PerMicrobatch` ("within a step") is that part of
:class:`~leakfree.diagnostics.detector.Detector`; it reports through the detector's
:class:`~leakfree.diagnostics.findings.Reporter`.
"""

from __future__ import annotations

from types import FrameType
from typing import Any, Protocol

from leakfree._text import format_bytes
from leakfree.diagnostics.retention import (
    Retained,
    RetentionReport,
    by_holder,
    group,
    holder_key,
)
from leakfree.diagnostics.rule import Rule


class Reporting(Protocol):
    """What the microbatch judge asks of the detector's reporter
    (:class:`~leakfree.diagnostics.findings.Reporter`): a search for holders, and a
    finding made of some; the findings so far and the watcher's name."""

    owner: str

    @property
    def findings(self) -> list[Any]: ...

    def search(self, frame: FrameType | None, *, everything: bool = False) -> RetentionReport: ...

    def found(
        self, kind: str, holders: list[Retained], per: float, lead: str, *, step: int
    ) -> None: ...

    def once(self, key: tuple[str, str]) -> bool: ...


#: bytes per step the C heap may drift in a clean loop (Python objects, caches): a heap
#: signal below it is not suspected (a leak's tensors and graph nodes are far above it)
HEAP_SLACK = 256
#: a microbatch's retention counts above this fraction of what the microbatch allocates
MICRO_FRACTION = 1 / 1024
#: between tracked steps, heap growth per backward above this fraction of what a
#: microbatch allocates starts a search (the heap moves by kilobytes in a clean loop)
HEAP_FRACTION = 1 / 128


class PerMicrobatch:
    """Judging each backward pass (see the module doc).

    Kept, until the detector is dropped: the live bytes after each backward of the
    current step, its first search's report (paths and byte counts) and the holders
    pending until the step ends; the search schedule."""

    def __init__(self, reporter: Reporting, rule: Rule) -> None:
        self._reporter = reporter
        self._rule = rule
        self._micro: list[int] = []  #: live bytes after each backward of this step
        self._made: list[int | None] = []  #: bytes allocated so far, at each backward
        self._made_per = 0.0  #: bytes a microbatch allocates, as last measured
        self._slack = 0.0  #: growth between backward passes within the measure's noise
        self.passes = 1  #: backward passes in the last step
        self._searches = 0  #: searches in this step
        self._missed = 0  #: searches in this step that found nothing to compare
        self._base: RetentionReport | None = None  #: this step's first search
        self._base_at = 0  #: the backward pass it was made after
        self._suspect = True  #: search after the next step's first backward
        #: holders that gained a tensor per microbatch, a finding if they fall back
        self._pending: tuple[list[Retained], RetentionReport | None, float, int, int] | None = None
        self._next = 1  #: the step from which a search may run
        self._backoff = 1
        #: the most kept per backward by what was found kept per microbatch: growth at that
        #: pace starts no search again (each walks every graph kept); a faster one does
        self._reported_per = 0.0

    def backward(
        self,
        live: int,
        frame: FrameType | None,
        *,
        steps: int,
        explained: float,
        made: int | None = None,
        noisy: bool = False,
    ) -> None:
        """A backward pass ended with ``live`` bytes alive, ``steps`` steps after the start
        (called by the tracker, through the detector).

        ``explained``: growth per step already accounted for (a leak reported, or the
        heap's drift); ``made``: bytes allocated so far (a running total), where the
        tracker can tell, so a retention is weighed against what a microbatch allocates;
        ``noisy``: ``live`` is the heap's count, which moves by kilobytes between backward
        passes of a clean loop (the engine's and Python's own allocations): only growth
        above a share of what a microbatch allocates starts a search.
        """
        micro = self._micro
        if len(micro) == 0:
            # Growth per backward that a leak already reported (or the heap's drift)
            # explains starts no search: each one walks every graph the leak keeps.
            found = bool(self._reporter.findings)
            self._slack = explained / self.passes if found or noisy else 0.0
            self._slack = max(self._slack, 2 * self._reported_per)
        micro.append(live)
        self._made.append(made)
        if made is not None and len(self._made) > 1 and self._made[-2] is not None:
            self._made_per = float(made - self._made[-2])  # what this microbatch allocated
        if noisy:
            self._slack = max(self._slack, HEAP_SLACK, self._made_per * HEAP_FRACTION)
        step = steps + 1
        if len(micro) == 1 and self._pending is not None:
            self._fell_back(frame, steps, last=True)
        if step < self._next or self._searches >= 3:
            return
        search = self._reporter.search
        if len(micro) == 1:
            # The baseline a later backward of this step is compared with: in the first
            # step, and after a step whose memory built up with nothing found.
            if self._suspect:
                self._suspect = False
                self._searches += 1
                self._base, self._base_at = search(frame, everything=True), 1
            return
        if micro[-1] - micro[-2] <= self._slack:
            return
        self._searches += 1
        report = search(frame, everything=True)
        base, at = self._base, self._base_at
        if base is None:
            self._base, self._base_at = report, len(micro)
        graphs, candidates = self._per_microbatch(report, base, len(micro) - at)
        per = (micro[-1] - micro[0]) / (len(micro) - 1)
        if graphs:
            kept = [i for i in report.items if i.kind == "ctx attribute"]  # what they pin
            self._micro_found(graphs + kept, per, len(micro), step)
        if candidates:  # a finding once they fall back: a cache that fills stays
            self._pending = (candidates, base, per, len(micro), step)
        elif not graphs:
            self._missed += 1
            if self._missed >= 2:  # nothing twice this step: search less often
                self._next = step + self._backoff
                self._backoff *= 2
                self._suspect = True

    def step_ended(self, frame: FrameType | None, steps: int) -> None:
        """Step ``steps + 1`` ended: what its microbatches kept and let go is judged, and
        the next step starts over (searched from its first backward if this one built up
        with nothing found)."""
        self._fell_back(frame, steps, last=False)
        micro = self._micro
        self.passes = max(len(micro), 1)
        grew = len(micro) > 1 and micro[-1] - micro[0] > self._slack * (len(micro) - 1)
        if grew and self._searches and not self._reporter.findings:
            self._suspect = True
        self._micro, self._made, self._searches, self._missed = [], [], 0, 0
        self._base = None

    def finish(self, frame: FrameType | None, steps: int) -> None:
        """The run ended: holders pending since the last step are looked at once more."""
        self._fell_back(frame, steps, last=True)

    def _micro_found(
        self, holders: list[Retained], per: float, passes: int, step: int, past: bool = False
    ) -> None:
        self._reported_per = max(self._reported_per, per)
        hints = [hint for part, hint in _MICRO_HINTS if any(part in h.where for h in holders)]
        what = (
            "memory builds up within the step (tensors kept for every microbatch until the "
            "step ends), so a step with more microbatches runs out of memory although "
            "nothing grows from step to step. "
        )
        if past:
            what = (
                "each microbatch's output is kept with its autograd graph, and still held "
                "after the step ended: memory builds up per microbatch and from step to "
                "step (keep ``.detach()`` or ``.item()`` of what is read later). "
            )
        self._reporter.found(
            "microbatch",
            holders,
            per,
            f"{self._reporter.owner}: +{format_bytes(per)} kept per backward pass over the "
            f"{passes} backward passes of step {step}: "
            + what
            + "".join(f"{hint} " for hint in hints)
            + "Held by:",
            step=step,
        )

    def _fell_back(self, frame: FrameType | None, steps: int, last: bool) -> None:
        """Are the pending holders of a step's microbatches let go now that it ended? Those
        that are were kept per microbatch: a finding. Looked at when the step ends and, for
        a holder emptied by a step-end callback that runs after ours, at the next step's
        first backward (``last``); then forgotten."""
        pending = self._pending
        if pending is None:
            return
        candidates, base, per, passes, step = pending
        report = self._reporter.search(frame, everything=True)
        now = by_holder(report.items + report.all_detached)
        before = by_holder(base.items + base.all_detached) if base is not None else {}
        fallen, waiting = [], []
        for held in candidates:
            key = holder_key(held)
            was = before.get(key)
            still = now.get(key)
            if still is None or still.nbytes <= (was.nbytes if was is not None else 0):
                fallen.append(held)
            else:
                waiting.append(held)
        self._pending = (waiting, base, per, passes, step) if waiting and not last else None
        kept = [h for h in waiting if h.kind == "graph"] if last else []
        if waiting and last:  # kept past the step: growth, judged across steps; search less
            self._next = steps + 1 + self._backoff
            self._backoff *= 2
        if fallen:
            self._micro_found(fallen, per, passes, step)
        if kept:  # a graph per microbatch, still held after the step: a leak at any length
            self._micro_found(kept, per, passes, step, past=True)
            for held in kept:  # reported: its growth across steps is not reported again
                self._reporter.once(("growth", holder_key(held)[1]))

    def _per_microbatch(
        self, report: RetentionReport, base: RetentionReport | None, passes: int
    ) -> tuple[list[Retained], list[Retained]]:
        """Holders that gained a tensor on every backward pass since ``base`` (``passes``
        ago), each tensor worth more than a floor relative to what a microbatch allocates.

        Returns two lists. First, several backpropagated graphs in one holder, each keeping
        more than ``graph_floor`` through its graph: a finding at once, without a baseline (the
        first step's second backward). Then candidates, found by comparison with ``base``:
        tensors with or without a graph (outputs, logits, losses kept with their value)
        that are a finding if they fall back when the step ends (:meth:`_fell_back`).
        Backpropagated losses kept only for their value (torch's pipelining schedules keep
        each microbatch's loss until the step ends), detached scalars and the step's own
        inputs (integer ids and masks, or fetched before its first backward) are neither.
        """
        floor = self._micro_floor()
        graphs = group([i for i in report.items if i.kind == "graph"])
        graph_floor = self._rule.graph_floor
        out = [g for g in graphs if g.count > 1 and g.through_graph / g.count > graph_floor]
        if base is None or passes < 1:
            return out, []
        named = {h.where for h in out}
        candidates = []
        before = by_holder(base.items + base.all_detached)
        for now in graphs + group(report.all_detached):
            if now.where in named:
                continue
            old = before.get(holder_key(now))
            # floating-point values of more than one element, with a graph or without
            # (not a scalar loss, not integer ids or masks): what a forward computed
            gained = now.floating - (old.floating if old is not None else 0)
            more = now.nbytes - (old.nbytes if old is not None else 0)
            if gained >= passes and more / gained > floor:
                candidates.append(now)
        return out, candidates

    def _micro_floor(self) -> float:
        """Bytes per kept tensor below which a microbatch's retention is a metric: the
        rule's ``graph_floor``, or a fraction of what one microbatch allocates, the larger."""
        return max(float(self._rule.graph_floor), self._made_per * MICRO_FRACTION)


#: what to do about a holder that a library keeps per microbatch by design, by a part of
#: its path: (part, advice)
_MICRO_HINTS = (
    (
        "output_chunks",
        "torch.distributed.pipelining keeps each microbatch's output on the last stage to "
        "return them merged: pass return_outputs=False to schedule.step() if the merged "
        "output is not read.",
    ),
)
