"""Findings: what a leak found is (:class:`Finding`), and the part of a
:class:`~leakfree.diagnostics.detector.Detector` that makes them (:class:`Reporter`, "the
reporter"): it searches for holders, names each once per holder and creation site, hands
each finding to the watcher's ``on_finding``, and says once that a search failed, never
raising into the run.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol

from leakfree._text import format_bytes
from leakfree.diagnostics.cycles import Cycles
from leakfree.diagnostics.growth import Growth
from leakfree.diagnostics.retention import (
    Retained,
    RetentionReport,
    find_retained,
    group,
    holder_key,
)
from leakfree.diagnostics.roots import frame_roots, module_roots
from leakfree.errors import LeakfreeWarning


class Tracked(Protocol):
    """What a detector reads from the tracker that owns it (a
    :class:`~leakfree.diagnostics.MemoryTracker`, which holds it): the device judged, and
    the storage tracker of a device counted storage by storage (else None)."""

    @property
    def judged(self) -> Any: ...

    @property
    def storage_tracker(self) -> Any: ...


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


class Reporter:
    """Makes findings from the holders a search returns (see the module doc).

    Kept, until the detector is dropped: the findings (names and byte counts, no
    tensors), what was reported (paths, kinds, creation sites) and whether a search
    failed. ``roots`` are walked only when a search runs."""

    def __init__(
        self,
        tracker: Tracked,
        *,
        owner: str,
        roots: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None,
        on_finding: Callable[[Finding], None] | None,
    ) -> None:
        self.tracker = tracker
        self.owner = owner  #: the name findings start with
        self.roots = roots
        self.on_finding = on_finding
        self.findings: list[Finding] = []
        self._reported: set[tuple[str, str]] = set()
        #: (finding kind, holder kind, creation site) -> the paths reported with it
        self._reported_sites: dict[tuple[str, str, str], list[str]] = {}
        #: the tensors of the graph holders reported, by id: a weak reference (nothing kept
        #: alive), and the finding's kind, the holder's path, its step and bytes per; a
        #: holder a later search finds holding one is named too (:meth:`_handed_over`)
        self._held: dict[int, tuple[weakref.ref[Any], str, str, int, float]] = {}
        self._broken = False  #: a search failed once (said once)

    def found(
        self,
        kind: str,
        holders: list[Retained],
        per: float,
        lead: str,
        *,
        step: int,
        growth: Growth | None = None,
        note: Callable[[Retained], str] | None = None,
    ) -> None:
        """A finding of ``kind`` in ``step``, of the ``holders`` not reported yet (or of no
        holder, once per kind), ``per`` bytes per step or backward, its message ``lead``
        followed by one line per holder (and ``note`` of it)."""
        grouped = group(holders)
        # Once per run: the same path, or the same holder reached from another root (from
        # the stack once, ``kept[*]``, and from a module's globals later, ``__main__.kept[*]``)
        # holding what the same line made.
        fresh = [
            h
            for h in grouped
            if (kind, holder_key(h)[1]) not in self._reported
            and not any(
                _same_holder(holder_key(h)[1], where)
                for where in self._reported_sites.get((kind, h.kind, h.site), ())
            )
        ]
        if (holders and not fresh) or (not holders and not self.once((kind, ""))):
            return  # reported already: once per run
        self._reported.update((kind, holder_key(h)[1]) for h in fresh)
        for h in fresh:
            for ref in h.held[:_MAX_HELD]:
                t = ref()
                if t is not None and len(self._held) < _MAX_HELD:
                    self._held.setdefault(id(t), (ref, kind, holder_key(h)[1], max(step, 1), per))
        for h in fresh:
            if h.site:
                self._reported_sites.setdefault((kind, h.kind, h.site), []).append(holder_key(h)[1])
        lines = "".join(f"\n  {_line(h)}{note(h) if note else ''}" for h in fresh[:8])
        more = f"\n  ... {len(fresh) - 8} more" if len(fresh) > 8 else ""
        self.emit(
            Finding(kind, lead + lines + more, per, max(step, 1), tuple(fresh), growth=growth)
        )

    def once(self, key: tuple[str, str]) -> bool:
        """Whether ``key`` (a finding's kind, and its holder's path or ``""``) is reported
        for the first time now."""
        if key in self._reported:
            return False
        self._reported.add(key)
        return True

    def emit(self, finding: Finding) -> None:
        self.findings.append(finding)
        if self.on_finding is not None:
            try:
                self.on_finding(finding)
            except Exception as e:  # a watcher asked to fail (LeakError): goes through
                e._leakfree_verdict = True  # type: ignore[attr-defined]
                raise

    def guard(self, call: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """``call(*args, **kwargs)``; an error of leakfree's own is warned once, never
        raised into the training step (a watcher asked to fail still raises its verdict)."""
        try:
            call(*args, **kwargs)
        except Exception as e:
            if getattr(e, "_leakfree_verdict", False):
                raise
            self.failed(e)

    def failed(self, error: Exception) -> None:
        """A search or probe failed: say so once; the run goes on, never broken by it."""
        if not self._broken:
            self._broken = True
            warnings.warn(
                f"{self.owner}: a holder search or measure failed ({type(error).__name__}: "
                f"{error}); the run goes on, its leaks may go unnamed. Please report it.",
                LeakfreeWarning,
                stacklevel=4,
            )

    def search(
        self,
        frame: FrameType | None,
        *,
        since: RetentionReport | None = None,
        everything: bool = False,
    ) -> RetentionReport:
        """The holders reachable from the roots given, the stack at ``frame`` and the
        user's module globals (an empty report if the walk failed: said once)."""
        try:
            report = self._walk(frame, since, everything)
        except Exception as e:  # never break a training step on a bug of ours
            self.failed(e)
            return RetentionReport()
        self.guard(self._handed_over, report)
        return report

    def _handed_over(self, report: RetentionReport) -> None:
        """Holders in growable containers (a list, a dict by step...) of graphs a finding
        named under another holder: named too, as holders of the same finding (torch's
        pipelining schedules keep each microbatch's loss, then hand them to the user's
        ``losses`` list at the step's end, where they stay until the next step's)."""
        if not self._held:
            return
        self._held = {k: v for k, v in self._held.items() if v[0]() is not None}
        graphs = [i for i in report.items if i.kind == "graph" and i.listed]
        matched: dict[str, tuple[str, str, int, float]] = {}  # holder -> what it also holds
        for item in graphs:
            for ref in item.held:
                t = ref()
                first = self._held.get(id(t)) if t is not None else None
                if first is not None and first[0]() is t and holder_key(item)[1] != first[2]:
                    matched.setdefault(holder_key(item)[1], first[1:])
        also: dict[tuple[str, str, int, float], list[Retained]] = {}
        for item in graphs:  # all of a holder's graphs, once one is the same
            same = matched.get(holder_key(item)[1])
            if same is not None:
                also.setdefault(same, []).append(item)
        for (kind, where, step, per), items in also.items():
            how = "kept per backward pass" if kind == "microbatch" else "kept across steps"
            self.found(
                kind,
                items,
                per,
                f"{self.owner}: the graphs {where} held ({how}, found in step {step}) "
                "are held here too:",
                step=step,
            )

    def _walk(
        self, frame: FrameType | None, since: RetentionReport | None, everything: bool
    ) -> RetentionReport:
        named: dict[str, Any] = {}
        extra = self.roots() if callable(self.roots) else self.roots
        for source in (extra or {}, frame_roots(frame), module_roots()):
            for name, value in source.items():
                if value is not None and name not in named:
                    named[name] = value
        storages = self.tracker.storage_tracker
        return find_retained(
            *named.values(),
            names=list(named),
            since=since,
            everything=everything,
            sites=storages.site if storages is not None else None,
        )


#: tensors of reported holders a reporter remembers (weakly), at most
_MAX_HELD = 4096


def _same_holder(a: str, b: str) -> bool:
    """Two paths to one holder from different roots: equal, or one is the other's tail
    after a dot (``kept[*]``, ``__main__.kept[*]``)."""
    return a == b or a.endswith("." + b) or b.endswith("." + a)


def _line(item: Retained) -> str:
    """``output_lst[*]['entropy']  4 graphs, 512 KiB  created at train.py:42 in f``."""
    if item.kind == "graph":
        what = f"{item.count} graphs" if item.count > 1 else "graph"
    elif item.kind == "detached":
        what = f"{item.count} tensor(s) without a graph"
    else:
        what = item.kind
    made = f"  created at {item.site}" if item.site else ""
    note = f", {item.note}" if item.note else ""
    return f"{item.where}  {what}, {format_bytes(item.nbytes)}{note}{made}"
