"""The detector's rule: when live bytes are a leak, and who is told what holds them.

A :class:`Detector` reads the live bytes a :class:`~leakfree.diagnostics.MemoryTracker`
samples at two boundaries and turns them into :class:`Finding` s:

**Within a step** (after every backward pass, see
:mod:`~leakfree.diagnostics.boundaries`): when the bytes alive after a backward exceed those
after the one before, the holders are searched (the locals of the frames on the stack, the
user's module globals, the watcher's roots). Backpropagated graphs from several
microbatches in one holder (``output_lst[*]['entropy']``), each keeping more than
``floor`` bytes through its graph (saved tensors, ctx state, leaves: what detaching would
free), are a finding at once, in the first step: memory that builds up per microbatch
and comes back at the step's end never shows as growth between steps. Detached values
kept until the step ends (a loss history for logging) are the user's metrics: no finding.

**Across steps** (at every ``step()`` after ``warmup`` steps): the slope over the last
``window`` steps (:func:`~leakfree.diagnostics.fit_growth`, robust to a bounded fill) must
exceed its noise bound, ``tolerance``, and grow in both halves of the window. Then:

* growth that holds autograd graphs (a backpropagated graph in a growable container, a
  graph kept by ``retain_graph=True``, ctx state kept after backward) is a finding
  whatever its size: a loss with its graph kept every step is 4 B per step;
* tensors held only by reference cycles: a finding that says whether gc is disabled, how
  many bytes ``gc.collect()`` would free and the cycle's path
  (:mod:`~leakfree.diagnostics.cycles`);
* any other growth (detached tensors in a container, a holder not found) is a finding
  above ``floor`` bytes per step (64 by default: a loss history of a few scalars per
  step is not a leak).

Once, at the first step after the warm-up, with automatic collection on: tensors made
during the run (on an allocator-read device: tensors on that device) that sit in
reference cycles are reported as freed late. That probe is one full collection (0.1-0.2 s
with transformers imported), once per run.

Searches cost milliseconds; one that finds nothing backs off (it waits twice as many steps
before the next), so a loop that grows within noise never pays for a search per step.
Each holder is reported once per run.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol

import torch

from leakfree._text import format_bytes
from leakfree._warnings import LeakfreeWarning
from leakfree.diagnostics.cycles import Cycles, find_cycles
from leakfree.diagnostics.growth import Growth, fit_growth
from leakfree.diagnostics.retention import Retained, RetentionReport, find_retained, group
from leakfree.diagnostics.roots import frame_roots, module_roots


class Tracked(Protocol):
    """What a detector reads from the tracker that owns it (a
    :class:`~leakfree.diagnostics.MemoryTracker`, which holds it): the device judged, and
    the storage tracker of a device counted storage by storage (else None)."""

    @property
    def judged(self) -> Any: ...

    @property
    def _storages(self) -> Any: ...


__all__ = ["DEFAULT_FLOOR", "Detector", "Finding", "Rule", "whole"]

#: bytes per step of detached growth accepted without a finding
DEFAULT_FLOOR = 64


def whole(owner: str, name: str, value: Any, least: int) -> int:
    """``value`` if it is an int (not a bool) >= ``least``; else a ``ValueError`` that names
    the argument as ``owner(name=value)``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{owner}({name}={value!r}): expected an int >= {least}")
    return value


@dataclass(frozen=True)
class Rule:
    """What counts as a leak (see the module doc)."""

    warmup: int = 2  #: steps not judged across steps (caches, optimizer state, compile)
    window: int = 10  #: steps per across-step verdict (the most recent ones)
    tolerance: float = 0.0  #: bytes per step accepted beyond the noise bound
    floor: float = DEFAULT_FLOOR  #: bytes per step of growth without graphs accepted

    def check(self, owner: str) -> Rule:
        """Itself, or a ``ValueError`` naming the bad field."""
        whole(owner, "warmup", self.warmup, 0)
        whole(owner, "window", self.window, 4)
        for name in ("tolerance", "floor"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0 <= value < float("inf")
            ):
                raise ValueError(
                    f"{owner}({name}={value!r}): expected a finite number of bytes per step >= 0"
                )
        return self


@dataclass(frozen=True)
class Finding:
    """One leak found: what it is, its size, its holders and where they were made."""

    #: "microbatch" (builds up per backward within a step), "growth" (across steps),
    #: "cycles" (held by reference cycles), "late cycles" (freed late, at gc's pace)
    kind: str
    message: str
    bytes_per: float  #: per backward ("microbatch") or per step; for cycles, bytes held
    step: int  #: the step it was found in (1 is the first)
    holders: tuple[Retained, ...] = ()
    cycles: Cycles | None = None
    growth: Growth | None = None

    def __str__(self) -> str:
        return self.message


@dataclass
class Detector:
    """Judges one tracker's samples by a :class:`Rule`; see the module doc.

    ``roots`` (``{name: object}``, or a callable returning one, called only when
    searching) are searched before module globals and stack frames; ``on_finding`` is
    called with each new :class:`Finding` (a watcher warns or raises there).
    """

    tracker: Tracked
    owner: str = "MemoryTracker"
    rule: Rule = field(default_factory=Rule)
    roots: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None
    on_finding: Callable[[Finding], None] | None = None
    findings: list[Finding] = field(default_factory=list)
    unit: str = "steps"  #: what a step is, in messages ("optimizer steps")

    def __post_init__(self) -> None:
        self.rule.check(self.owner)
        self.steps = 0  #: step boundaries seen
        self.growth: Growth | None = None  #: the last across-step verdict's growth
        self._micro: list[int] = []  #: live bytes after each backward of this step
        self._micro_searches = 0  #: searches in this step
        self._values: list[int] = []  #: live bytes per judged step, the last window
        self._at: list[int] = []  #: the step of each value
        self._next_search = 0  #: the step from which an across-step search may run
        self._backoff = 1
        self._next_micro = 1  #: the step from which a microbatch search may run
        self._micro_backoff = 1
        self._last: RetentionReport | None = None
        self._reported: set[tuple[str, str]] = set()
        self._probed = False
        self._broken = False  #: a search failed once (said once)

    # -- boundaries ------------------------------------------------------------------

    def backward(self, live: int, frame: FrameType | None) -> None:
        """A backward pass ended with ``live`` bytes alive (called by the tracker)."""
        micro = self._micro
        micro.append(live)
        step = self.steps + 1
        if len(micro) < 2 or micro[-1] <= micro[-2] or step < self._next_micro:
            return
        if self._micro_searches >= 2:
            return
        self._micro_searches += 1
        report = self._search(frame)
        # Graphs of several microbatches in one holder, each keeping more through its graph
        # than ``floor`` beyond its own value: torch's pipelining schedules keep every
        # microbatch's backpropagated loss until the step ends, a value like a metric.
        graphs = group([i for i in report.items if i.kind == "graph"])
        several = [g for g in graphs if g.count > 1 and g.through_graph / g.count > self.rule.floor]
        if not several:
            if self._micro_searches >= 2:  # nothing twice this step: search less often
                self._next_micro = step + self._micro_backoff
                self._micro_backoff *= 2
            return
        per = (micro[-1] - micro[0]) / (len(micro) - 1)
        kept = [i for i in report.items if i.kind == "ctx attribute"]  # what they pin
        self._found(
            "microbatch",
            several + kept,
            per,
            f"{self.owner}: +{format_bytes(per)} kept per backward pass over the "
            f"{len(micro)} backward passes of step {step}: memory builds up within the step "
            "(autograd graphs kept for every microbatch), so a step with more microbatches "
            "runs out of memory although nothing grows from step to step. Held by:",
        )

    def step(self, live: int | None, frame: FrameType | None) -> None:
        """A step ended with ``live`` bytes alive (None: a step not sampled)."""
        self.steps += 1
        self._micro, self._micro_searches = [], 0
        if self.steps <= self.rule.warmup:
            return
        if not self._probed and gc.isenabled():  # at the first step after the warm-up,
            self._probed = True  # tracked or not: a one-off cost at a known place
            self._cycles()
        if live is None:
            return
        self._values.append(live)
        self._at.append(self.steps)
        del self._values[: -self.rule.window], self._at[: -self.rule.window]
        if len(self._values) >= self.rule.window:
            self.judge(frame)

    def judge(self, frame: FrameType | None = None) -> None:
        """Judge the recent steps now; any finding goes to ``findings``."""
        if len(self._values) < 4:
            return
        growth = fit_growth(self._values)
        self.growth = growth
        if not growth.exceeds(self.rule.tolerance) or self.steps < self._next_search:
            return
        found = self._across(growth, frame)
        if found:
            self._backoff = 1
        else:
            self._next_search = self.steps + self._backoff
            self._backoff *= 2

    # -- verdicts --------------------------------------------------------------------

    def _across(self, growth: Growth, frame: FrameType | None) -> bool:
        report = self._search(frame, since=self._last)
        self._last = report
        first = self._at[-growth.steps] if len(self._at) >= growth.steps else 1
        span = self.steps - first + 1
        sampled = f", {growth.steps} of them tracked" if span > growth.steps else ""
        lead = (
            f"{self.owner}: memory grows by {growth} on {self.tracker.judged} over "
            f"{self.unit} {first}-{self.steps} ({span} steps after a {self.rule.warmup}-step "
            f"warm-up{sampled}; {format_bytes(growth.first)} -> {format_bytes(growth.last)})"
        )
        if report.items:
            return self._found(
                "growth", report.items, growth.bytes_per_step, f"{lead}, held by:", growth
            )
        if self._cycles(growth):
            return True
        if growth.bytes_per_step <= max(self.rule.floor, self.rule.tolerance):
            return False  # a few detached scalars per step: a metric history, not a leak
        seen = report.detached
        if not seen:  # what a clean loop holds too: graphs before backward, detached tensors
            full = self._search(frame, everything=True)
            seen = [i for i in full.items if i.kind == "graph"] + full.detached
        if seen:
            return self._found(
                "growth",
                seen,
                growth.bytes_per_step,
                f"{lead}; no backpropagated graph holds it. What holds tensors (graphs not "
                "backpropagated, tensors without a graph):",
                growth,
            )
        made = ""
        storages = self.tracker._storages
        if storages is not None:  # no holder: at least the lines that made what grew
            grown = storages.alive_by_site(first - 1)  # epoch k-1: made in step k
            made = "".join(
                f"\n  created at {site}: {count} storage(s), {format_bytes(nbytes)}"
                for site, count, nbytes in grown[:5]
            )
        return self._found(
            "growth",
            [],
            growth.bytes_per_step,
            f"{lead}; no holder found among the module globals, the stack and the roots "
            "given: it is held where a walk cannot see (C++: hooks on graph nodes, an "
            "extension's objects) or by an object you can pass as roots=...; what grew "
            f"since step {first}, by the line that made it:{made or ' unknown'}",
            growth,
        )

    def _cycles(self, growth: Growth | None = None) -> bool:
        storages = self.tracker._storages
        try:
            if storages is not None:  # only tensors made while watching are charged to it
                cycles = find_cycles(site=storages.site, mine=storages.tracks)
            else:  # an allocator's count: the tensors on the judged device
                judged = torch.device(self.tracker.judged)
                cycles = find_cycles(mine=lambda t: t.device == judged)
        except Exception as e:  # never break a training step on a bug of ours
            self._failed(e)
            return False
        if cycles is None:
            return False
        kind = "late cycles" if cycles.gc_enabled else "cycles"
        key = (kind, "")
        if key in self._reported:
            return True
        self._reported.add(key)
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
        self._emit(finding)
        return True

    def _found(
        self,
        kind: str,
        holders: list[Retained],
        per: float,
        lead: str,
        growth: Growth | None = None,
    ) -> bool:
        grouped = group(holders)
        fresh = [h for h in grouped if (kind, h.where) not in self._reported]
        if (holders and not fresh) or (not holders and (kind, "") in self._reported):
            return True  # reported already: once per run
        self._reported.update((kind, h.where) for h in fresh)
        if not holders:
            self._reported.add((kind, ""))
        lines = "".join(f"\n  {_line(h)}" for h in fresh[:8])
        more = f"\n  ... {len(fresh) - 8} more" if len(fresh) > 8 else ""
        finding = Finding(
            kind, lead + lines + more, per, max(self.steps, 1), tuple(fresh), growth=growth
        )
        self._emit(finding)
        return True

    def _emit(self, finding: Finding) -> None:
        self.findings.append(finding)
        if self.on_finding is not None:
            self.on_finding(finding)

    def _failed(self, error: Exception) -> None:
        """A search or probe failed: say so once; the run goes on, never broken by it."""
        if not self._broken:
            self._broken = True
            warnings.warn(
                f"{self.owner}: a holder search failed ({type(error).__name__}: {error}); "
                "leaks are still measured, their holders may go unnamed. Please report it.",
                LeakfreeWarning,
                stacklevel=4,
            )

    def _search(
        self,
        frame: FrameType | None,
        *,
        since: RetentionReport | None = None,
        everything: bool = False,
    ) -> RetentionReport:
        try:
            return self._walk(frame, since, everything)
        except Exception as e:  # never break a training step on a bug of ours
            self._failed(e)
            return RetentionReport()

    def _walk(
        self, frame: FrameType | None, since: RetentionReport | None, everything: bool
    ) -> RetentionReport:
        named: dict[str, Any] = {}
        extra = self.roots() if callable(self.roots) else self.roots
        for source in (extra or {}, frame_roots(frame), module_roots()):
            for name, value in source.items():
                if value is not None and name not in named:
                    named[name] = value
        storages = self.tracker._storages
        return find_retained(
            *named.values(),
            names=list(named),
            since=since,
            everything=everything,
            sites=storages.site if storages is not None else None,
        )


def _line(item: Retained) -> str:
    """``output_lst[*]['entropy']  4 graphs, 512 KiB  created at train.py:42 in f``."""
    if item.kind == "graph":
        what = f"{item.count} graphs" if item.count > 1 else "graph"
    elif item.kind == "detached":
        what = f"{item.count} tensor(s) without a graph"
    else:
        what = item.kind
    made = f"  created at {item.site}" if item.site else ""
    return f"{item.where}  {what}, {format_bytes(item.nbytes)}{made}"
