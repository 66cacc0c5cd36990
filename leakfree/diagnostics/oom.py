"""The report at an out-of-memory error: what a watched run knew when memory ran out.

An out-of-memory error is the moment a user asks what holds the memory, and the moment
the answer is cheapest to get right: what grew is in the tracker's series, and the
objects that hold it are still reachable from the frames the error unwinds through. At an
out-of-memory error (:func:`is_out_of_memory`) :func:`report` says, from what a
:class:`~leakfree.diagnostics.MemoryTracker` recorded so far:

* what grew: the judged device's live bytes from the end of the warm-up to the last
  step, per step, and on an accelerator whether what grew is allocated (held by tensors)
  or the allocator's cache (:mod:`~leakfree.diagnostics.cache`);
* the findings made so far;
* who holds the most: one search from the frame that raised (its locals and those of
  every caller, the user's module globals), holders biggest first, each with the line
  that created what it holds where the storage tracker saw it made;
* the lines that created what is alive: the storage tracker's live storages by creating
  line where storages are tracked; on CUDA, the allocator's own record of the blocks in
  use by allocating line (:func:`~leakfree.diagnostics.snapshot.top_allocation_sites`,
  with lines where ``torch.cuda.memory._record_memory_history()`` was on).

The report is text and plain data (:class:`OutOfMemoryReport`): it keeps no tensor, no
frame and no holder alive. Building it never raises; the error itself is left to its
caller to re-raise unchanged.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from leakfree._text import format_bytes
from leakfree.diagnostics.growth import fit_growth
from leakfree.diagnostics.retention import Retained, group

if TYPE_CHECKING:
    from leakfree.diagnostics.memory import MemoryTracker

__all__ = ["OutOfMemoryReport", "is_out_of_memory", "report"]

#: the most holders and creating lines listed
TOP = 8

#: what the allocators say when they run out (CUDA's and the accelerators' raise
#: ``torch.OutOfMemoryError``; the CPU's and some backends' a plain ``RuntimeError``)
_SAYS = ("out of memory", "can't allocate memory", "not enough memory")


def is_out_of_memory(error: BaseException | None) -> bool:
    """Whether ``error`` is a device or host allocator running out of memory."""
    if error is None:
        return False
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error).lower() for s in _SAYS)


@dataclass(frozen=True)
class OutOfMemoryReport:
    """What a watched run knew at an out-of-memory error (see the module doc): ``text``
    for a human, the parts as plain data for ``--json``."""

    step: int  #: the steps completed when memory ran out
    error: str  #: the error's first line
    device: str
    grew: str  #: what the judged device's live bytes did, as a sentence
    findings: list[str] = field(default_factory=list)  #: the findings' messages
    holders: list[dict[str, Any]] = field(default_factory=list)  #: biggest first
    lines: list[dict[str, Any]] = field(default_factory=list)  #: creating lines, most first
    text: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "error": self.error,
            "device": self.device,
            "grew": self.grew,
            "findings": list(self.findings),
            "holders": list(self.holders),
            "lines": list(self.lines),
        }


def report(tracker: MemoryTracker, error: BaseException, *, owner: str) -> OutOfMemoryReport:
    """The report at ``error`` from what ``tracker`` recorded (see the module doc)."""
    device = tracker.judged
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    try:
        grew = _grew(tracker, device)
    except Exception as e:  # a report must not hide the error it reports
        grew = f"not read ({type(e).__name__}: {e})"
    findings = [f.message for f in tracker.findings]
    holders = _holders(tracker, error)
    lines = _lines(tracker, torch.device(device))
    steps = tracker.detector.steps
    text = [f"{owner}: out of memory after {steps} steps on {device} ({first_line}); so far:"]
    text.append(f"  what grew: {grew}")
    for kind, verdict in tracker.allocator_verdicts().items():
        if verdict.kind != "none":
            text.append(f"  {kind}: {verdict.message}")
    text.extend("  found: " + f.replace("\n", "\n  ") for f in findings)
    if holders:
        text.append("  who holds the most now:")
        text.extend(f"    {h}" for h in holders)
    else:
        text.append("  who holds the most now: no holder reachable from the frames or globals")
    if lines:
        text.append(f"  what is alive by the line that created it ({lines[0]['source']}):")
        text.extend(
            f"    {line['line']}  {format_bytes(line['bytes'])} in {line['count']}"
            for line in lines
        )
    return OutOfMemoryReport(
        steps,
        first_line,
        device,
        grew,
        findings,
        [h.as_dict() for h in holders],
        lines,
        "\n".join(text),
    )


def _grew(tracker: MemoryTracker, device: str) -> str:
    values = tracker.series.get(device, [])
    steps = tracker.steps.get(device, [])
    if len(values) < 2:
        return f"fewer than two steps recorded on {device}: no growth to measure"
    if tracker.storage_tracker is not None and tracker.sample_every > 1:
        # Storages are counted on the steps tracked only: a series that undercounts what
        # untracked steps made. The detector's last judgement is over exact values.
        judged = tracker.detector.growth
        rate = f"; the last judged: {judged}" if judged is not None else ""
        return (
            f"{len(values)} of {tracker.detector.steps} steps counted storage by storage "
            f"(one step in about {tracker.sample_every} is tracked){rate}"
        )
    skip = tracker.detector.rule.warmup
    kept = [(v, i) for v, i in zip(values, steps) if i >= skip]
    if len(kept) < 2:
        kept = list(zip(values, steps))
    growth = fit_growth([v for v, _ in kept], [i for _, i in kept])
    (first, a), (last, b) = kept[0], kept[-1]
    return (
        f"live bytes went from {format_bytes(first)} at step {a + 1} to {format_bytes(last)} "
        f"at step {b + 1} ({growth})"
    )


def _frame(error: BaseException) -> types.FrameType | None:
    """The innermost frame the error unwound through whose callers lead back to where it
    was caught: its locals, then its callers'. (A kernel that ran out of memory in
    backward was called by the autograd engine, from C++: its frames lead nowhere.)"""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    if not frames:
        return None
    for frame in reversed(frames):
        up: types.FrameType | None = frame
        while up is not None and up is not frames[0]:
            up = up.f_back
        if up is not None:
            return frame
    return frames[-1]


def _holders(tracker: MemoryTracker, error: BaseException) -> list[Retained]:
    found = tracker.detector.reporter.search(_frame(error), everything=True)
    # one line per holder: a list's graphs as ``losses[*]``, not one line per item
    items = sorted(group([*found.items, *found.detached]), key=lambda r: -r.nbytes)
    return [r for r in items[:TOP] if r.nbytes > 0]


def _lines(tracker: MemoryTracker, device: torch.device) -> list[dict[str, Any]]:
    storages = tracker.storage_tracker
    if storages is not None:
        rows = storages.alive_by_site(0)[:TOP]
        return [
            {"line": s, "count": f"{n} storage(s)", "bytes": b, "source": "storages tracked"}
            for s, n, b in rows
        ]
    if device.type != "cuda":
        return []
    try:
        from leakfree.diagnostics.snapshot import top_allocation_sites

        snap = torch.cuda.memory._snapshot(device)
        sites = top_allocation_sites(snap, TOP)
    except Exception:  # no allocator record to read: nothing to say
        return []
    return [
        {
            "line": s.site,
            "count": f"{s.blocks} block(s)",
            "bytes": s.bytes,
            "source": "the allocator's blocks in use; lines need "
            "torch.cuda.memory._record_memory_history() on",
        }
        for s in sites
    ]
