"""``leakfree.watch()``: the detector on any training loop, boundaries found by themselves.

Every training loop, whatever its framework, calls ``optimizer.step()`` once per step and
``backward()`` once per microbatch. A :class:`Watch` takes its boundaries from there:

* **steps**: every ``torch.optim.Optimizer``'s step, through torch's global
  ``register_optimizer_step_post_hook`` (optimizers created late, and several at once, are
  seen); a step that follows another with no backward pass between them (two optimizers
  stepped back to back) is the same step, unless the loop never ran a backward pass;
* **microbatches**: every backward pass (:mod:`~leakfree.diagnostics.boundaries`);
* a loop with no optimizer (a hand-written SGD, ``torch.autograd.grad`` updates): after
  ``fallback`` backward passes without an optimizer step, each backward pass is a step, and
  the watch says so once.

The findings are those of :mod:`~leakfree.diagnostics.detector`, reported as they are made
(``on_finding``, by default a :class:`~leakfree.MemoryGrowthWarning`) and kept for
:meth:`Watch.report`.

Lifetime: from :meth:`Watch.start` to :meth:`Watch.stop` (or the ``with`` block) a
:class:`~leakfree.diagnostics.MemoryTracker` is entered on the starting thread and the
optimizer hook is registered; ``stop`` removes both (idempotent). The findings (text and
byte counts, no tensors) stay.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

import leakfree._args as _args
from leakfree._text import format_bytes
from leakfree.diagnostics.boundaries import on_backward
from leakfree.diagnostics.cache import CacheVerdict
from leakfree.diagnostics.detector import Finding, Rule, whole
from leakfree.diagnostics.memory import MemoryTracker, weak_method
from leakfree.diagnostics.oom import OutOfMemoryReport, is_out_of_memory
from leakfree.diagnostics.oom import report as oom_report
from leakfree.diagnostics.roots import judged_device, named_roots
from leakfree.diagnostics.stores import ParameterState
from leakfree.errors import MemoryGrowthWarning

__all__ = ["Watch", "watch"]


class Watch:
    """The detector over a training loop, with step and microbatch boundaries of its own.

    Args:
        warmup: steps not judged across steps (retention per microbatch is judged from
            the first step).
        window: the most recent steps judged at every step (at least 4).
        sample_every: on a device counted by the storage tracker (the CPU), track storages
            during about one step in this many (the first always; 1: every step, exact).
        floor: bytes per step of growth accepted when no autograd graph holds it.
        tolerance: bytes per step accepted beyond the noise bound.
        device: the device judged (default: the accelerator if any, read from its
            allocator; else the CPU).
        roots: more objects to search for holders, ``{name: object}`` or a list.
        fallback: backward passes without an optimizer step after which each backward
            pass is a step.
        on_finding: called with each :class:`~leakfree.diagnostics.Finding` as it is made
            (default: warn :class:`~leakfree.MemoryGrowthWarning`).
        owner: the name findings start with.
    """

    def __init__(
        self,
        *,
        warmup: int | None = None,
        window: int | None = None,
        sample_every: int = 8,
        floor: float | None = None,
        tolerance: float | None = None,
        device: str | torch.device | None = None,
        roots: Mapping[str, Any] | Iterable[Any] | None = None,
        fallback: int = 32,
        on_finding: Callable[[Finding], None] | None = None,
        owner: str = "leakfree.watch",
    ) -> None:
        rule = Rule.of(
            "watch", "watching", warmup=warmup, window=window, tolerance=tolerance, floor=floor
        )
        whole("watch", "sample_every", sample_every, 1)
        whole("watch", "fallback", fallback, 1)
        judged = judged_device("watch", device)
        named = named_roots("watch", roots)
        _args.function("watch", "on_finding", on_finding, none=True)
        _args.text("watch", "owner", owner)
        self.rule, self.sample_every, self.fallback = rule, sample_every, fallback
        self.device = judged
        self.roots = named
        self.on_finding = on_finding
        self.owner = owner
        self.steps = 0  #: step boundaries seen
        self.backwards = 0  #: backward passes seen
        self.optimizer_steps = 0  #: optimizer steps seen
        self.per_backward = False  #: no optimizer: each backward pass is a step
        self.notes: list[str] = []  #: what the watch had to say besides findings
        self.rank: int | None = None  #: the process group rank, once one is seen
        self._since_step = 0  #: backward passes since the last step boundary
        self._tracker: MemoryTracker | None = None
        self._handles: list[Any] = []
        self._findings: list[Finding] = []
        self._thread = 0
        self._params = ParameterState()  #: the optimizers seen, weakly: their state's bytes
        #: what the run's end said of growth: withdrawn findings and why, growth that
        #: stopped (``grew by ... then flat``), growth that stands and why
        self.revisions: list[str] = []
        #: the verdict when the watch last stopped: (verdict, judged steps, needed, why not)
        self._verdict: tuple[str, int, int, str] = ("not judged", 0, rule.window, "")
        #: per device, the allocator's verdict when the watch stopped (cache or leak)
        self.allocator: dict[str, CacheVerdict] = {}
        #: the report made at an out-of-memory error, if one ended the watch
        self.oom: OutOfMemoryReport | None = None

    # -- lifetime ----------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self._tracker is not None

    def start(self) -> Watch:
        """Start watching (idempotent while active); returns ``self``."""
        if self._tracker is not None:
            return self
        tracker = MemoryTracker(
            devices=[self.device],
            sample_every=self.sample_every,
            rule=self.rule,
            roots=self.roots,
            warn=False,
            on_finding=weak_method(self._found),  # weakly: no cycle through the watch
            owner=self.owner,
        )
        self._thread = threading.get_ident()
        tracker.__enter__()
        tracker.detector.whole.parameter_state = self._params.bytes
        self._tracker = tracker
        from torch.optim.optimizer import register_optimizer_step_post_hook as hook

        self._handles = [
            hook(weak_method(self._optimizer_step)),
            on_backward(weak_method(self._backward)),
        ]
        return self

    def stop(self) -> None:
        """Stop watching (idempotent); the findings stay."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            try:
                tracker.detector.finish()  # growth being confirmed: judged on what is in
            finally:
                self._verdict = _verdict_of(tracker.detector)
                self.allocator = tracker.allocator_verdicts()
                self._revised(tracker.detector)
                tracker.__exit__(None, None, None)

    def _revised(self, detector: Any) -> None:
        """The end's verdict over the whole run: findings it withdrew are dropped, what it
        said is kept for the report."""
        kept = detector.findings
        self._findings = [f for f in self._findings if f.kind != "growth" or f in kept]
        self.revisions += detector.whole.said

    def out_of_memory(self, error: BaseException) -> OutOfMemoryReport | None:
        """The report so far at ``error``, an out-of-memory error raised while watching
        (:mod:`~leakfree.diagnostics.oom`), kept as :attr:`oom`; None when the watch is
        not active or ``error`` is another error. Call it before :meth:`stop`, where the
        error is caught; the error is the caller's to re-raise."""
        tracker = self._tracker
        if tracker is None or not is_out_of_memory(error):
            return None
        try:
            self.oom = oom_report(tracker, error, owner=self.owner)
        except Exception as e:  # the user's error comes first: say ours, never raise it
            self.notes.append(f"the out-of-memory report failed ({type(e).__name__}: {e})")
            return None
        return self.oom

    def __enter__(self) -> Watch:
        return self.start()

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        # An out-of-memory error leaves the block with the report so far on stderr; it is
        # re-raised unchanged (this returns None).
        oom = self.out_of_memory(error) if error is not None else None
        if oom is not None:
            print(oom.text, file=sys.stderr, flush=True)
        self.stop()

    # -- boundaries --------------------------------------------------------------------

    def _optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        self.optimizer_steps += 1
        self._params.seen(optimizer)
        if self.per_backward or (self._since_step == 0 and self.backwards):
            return  # a second optimizer stepped with no backward between: the same step
        self._step()

    def _backward(self, frame: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        self.backwards += 1
        self._since_step += 1
        if self.per_backward:
            self._step()
        elif self.optimizer_steps == 0 and self.backwards >= self.fallback:
            self.per_backward = True
            self.notes.append(
                f"no optimizer step after {self.backwards} backward passes: each backward "
                "pass is judged as a step"
            )
            self._step()

    def _step(self) -> None:
        self._since_step = 0
        if self.rank is None:
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized():
                self.rank = dist.get_rank()
        tracker = self._tracker
        if tracker is not None:
            self.steps += 1
            tracker.step()

    def _found(self, finding: Finding) -> None:
        self._findings.append(finding)
        if self.on_finding is not None:
            self.on_finding(finding)
        else:
            warnings.warn(finding.message, MemoryGrowthWarning, stacklevel=2)

    # -- results -----------------------------------------------------------------------

    @property
    def findings(self) -> list[Finding]:
        """The leaks found so far."""
        return list(self._findings)

    @property
    def growth(self) -> Any:
        tracker = self._tracker
        return tracker.detector.growth if tracker is not None else None

    @property
    def verdict(self) -> str:
        """``"leak"``, ``"clean"`` (judged over enough steps) or ``"not judged"`` (the run
        ended first): now, or as it stood when the watch stopped."""
        return self._state()[0]

    def _state(self) -> tuple[str, int, int, str]:
        tracker = self._tracker
        return _verdict_of(tracker.detector) if tracker is not None else self._verdict

    def report(self) -> str:
        """What was watched and what was found, for a human."""
        unit = "backward passes" if self.per_backward else "optimizer steps"
        head = (
            f"leakfree: {self.steps} steps ({unit}), {self.backwards} backward passes "
            f"watched on {self.device}"
        )
        lines = [head, *(f"leakfree: {note}" for note in self.notes)]
        lines += [f"leakfree: {line}" for line in self.revisions]
        verdict, judged, _, why = self._state()
        if verdict == "not judged":
            lines.append(
                f"leakfree: not judged: {why}; no leak was found in them and none is ruled "
                "out (a longer run, or --warmup/--window, gives a verdict)"
            )
        elif not self._findings:
            lines.append(f"leakfree: no leak found ({judged} steps judged after the warm-up)")
        else:
            lines.append(f"leakfree: {len(self._findings)} leak(s) found:")
            lines.extend(f.message for f in self._findings)
        for device, cache in self.allocator.items():
            if cache.kind != "none":
                lines.append(f"leakfree: on {device}, {cache.message}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """The findings as plain data (``--json``)."""
        verdict, judged, needed, why = self._state()
        return {
            "device": str(self.device),
            "verdict": verdict,
            "judged_steps": judged,
            "needed_steps": needed,
            "not_judged_because": why,
            "steps": self.steps,
            "backward_passes": self.backwards,
            "optimizer_steps": self.optimizer_steps,
            "per_backward": self.per_backward,
            "notes": list(self.notes),
            "revisions": list(self.revisions),
            "findings": [_finding_dict(f) for f in self._findings],
            "allocator": {device: dataclasses.asdict(v) for device, v in self.allocator.items()},
            "out_of_memory": self.oom.as_dict() if self.oom is not None else None,
        }


def _verdict_of(detector: Any) -> tuple[str, int, int, str]:
    return (
        detector.verdict,
        detector.judged_steps,
        detector.needed_steps,
        detector.why_not_judged(),
    )


def _finding_dict(finding: Finding) -> dict[str, Any]:
    return {
        "kind": finding.kind,
        "step": finding.step,
        "bytes_per": finding.bytes_per,
        "bytes_per_text": format_bytes(finding.bytes_per),
        "message": finding.message,
        "holders": [h.as_dict() for h in finding.holders],
        "cycle": finding.cycles.path if finding.cycles is not None else None,
    }


def watch(**options: Any) -> Watch:
    """Start a :class:`Watch` now and return it: ``w = leakfree.watch()`` ... ``print(w.report())``;
    ``w.stop()`` ends it (or use ``with leakfree.watch():``)."""
    return Watch(**options).start()
