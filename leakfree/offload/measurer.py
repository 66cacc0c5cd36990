"""A goal's measured and checked steps: :class:`Measurer` ("the measurer") is the part of
:class:`~leakfree.offload.OffloadActivations` that measures the first step of each shape
for a goal's plan (:class:`~leakfree.offload.measure.StepMeasure`) and, under a limit,
checks the step after a new plan against it. The front calls it with its lock held.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import torch

from leakfree._allocator import Counts, Span
from leakfree.offload.link import Link
from leakfree.offload.measure import Marks, StepMeasure
from leakfree.offload.options import Mode
from leakfree.offload.plan import Planner
from leakfree.offload.stats import OffloadStats


class Copies(Protocol):
    """What the measurer asks of the copies (:class:`~leakfree.offload.transfers.Transfers`,
    handed in by the front): the device and its module, the link, and how the compute
    stream waits for a copy (timed in a measured step)."""

    device: torch.device | None
    module: Any
    wait: Callable[[Any, Any], None]
    read: Callable[[], Counts] | None

    def link(self, nbytes: int) -> Link: ...


__all__ = ["Measurer"]


class Measurer:
    """A goal's measured and checked steps (see the module doc): the step being measured
    (:attr:`measuring`: until its backward ends); the step that checks a new plan (what
    the device allocated and held over it, and its time: one host wait at its end); and,
    under a limit, every other step's held memory. Events and numbers only; the user's
    peak statistics are never reset (:class:`~leakfree._allocator.Span`). Called
    under the manager's lock."""

    def __init__(self, planner: Planner, transfers: Copies, stats: OffloadStats) -> None:
        self._planner = planner
        self._transfers = transfers
        self._stats = stats
        self.measuring: StepMeasure | None = None
        #: the step watched now: what the device held over it, and (a plan's check) marks
        #: at its start, for its time
        self._watch: Span | None = None
        self._timing: Marks | None = None
        self._plain_wait = transfers.wait  # restored when a measured step ends

    def reset(self) -> None:
        """The options changed: nothing measured or checked so far counts."""
        self._measure(None)
        self._unwatch()

    def _unwatch(self) -> None:
        self._watch = None
        self._timing = None

    def _measure(self, step: StepMeasure | None) -> None:
        """``step`` is the one measured now (None: none); its waits for copies are timed."""
        self.measuring = step
        self._transfers.wait = step.wait if step is not None else self._plain_wait

    def begin_forward(self) -> None:
        """A forward begins: measured, if a goal has no plan; checked, if its plan is new
        (where the device reports its allocator); under a limit, watched: corrected if it
        holds more than the limit (lengths the plan was not made for)."""
        planner = self._planner
        transfers = self._transfers
        if not planner.mode.goal:
            return
        device = cast(torch.device, transfers.device)
        if planner.split is None:
            self._measure(
                StepMeasure(device, transfers.module, self._stats.to_host_bytes, transfers.read)
            )
            return
        read = transfers.read
        if read is None or not (planner.check is not None or planner.mode is Mode.LIMIT):
            return
        self._watch = Span(read)
        self._timing = None
        if planner.check is not None:
            self._timing = Marks(device, transfers.module)
            self._timing.mark()

    def forward_ended(self, sizes: tuple[int, ...]) -> None:
        """A forward of other shapes than the plan's ended (``sizes``: its copies'): the
        measured step's forward is done; any other makes the next step a measured one."""
        measuring = self.measuring
        if measuring is not None and measuring.sizes is None:
            measuring.forward_done(sizes)
        else:
            self._planner.forget()
            self._measure(None)
            self._unwatch()  # the plan it would check is gone

    def outgrown(self) -> None:
        """The plan was made again for a forward of larger lengths (it ran under the old
        one): this step is not its check; the next of these lengths is."""
        self._unwatch()

    def pass_ended(self) -> None:
        """A backward pass is over: the measured step's makes the plan for its shapes (one
        host wait, for its last mark, and the link's probe once); the checked step's time
        and held peak are weighed by the planner, as is a watched step's held peak."""
        measuring = self.measuring
        if measuring is not None and measuring.backward is not None:
            self._measure(None)
            measured = measuring.finish(self._stats.to_host_bytes, self._transfers.link)
            if measured is None:  # saves the plan did not see: the next step is measured
                return
            measurement, rises = measured
            planner = self._planner
            planner.observed = None  # a new plan: nothing measured of it yet
            planner.adopt(measurement, measuring.allocated, checkable=measuring.module is not None)
            planner.rises = rises
            planner.replans += 1
            self._release_cache()
            return
        watch, timing = self._watch, self._timing
        if watch is None:
            return
        self._unwatch()
        watch.read()
        planner = self._planner
        split = planner.split
        if planner.check is not None and timing is not None:
            timing.mark()
            planner.checked(watch.held, timing.seconds()[-1])
        else:
            planner.overshot(watch.held)
        if planner.check is not None and planner.split != split:  # a new plan, checked in turn
            self._release_cache()

    def relengthed(self) -> None:
        """A forward began with other lengths than the step before it. Under a limit, what
        the caching allocator cached for those lengths goes back to the device first: its
        blocks, of the old sizes, would stay held beside the new ones the new lengths
        allocate, and take the step over the limit (a forward of the same lengths reuses
        them: nothing is released then). Once per change of lengths."""
        if self._planner.mode is Mode.LIMIT:
            self._release_cache()

    def _release_cache(self) -> None:
        """A new plan: what the caching allocator keeps of the steps before it (blocks
        laid out for another plan, or for a measured step that kept everything) goes back
        to the device, so that what the device holds from now on is the plan's. (On
        CUDA, ``empty_cache`` waits for the device: once per plan.)"""
        empty = getattr(self._transfers.module, "empty_cache", None)
        if empty is not None:
            empty()
