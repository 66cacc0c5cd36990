"""A goal's measured and checked steps: :class:`Measurer` ("the measurer") is the part of
:class:`~leakfree.offload.OffloadActivations` that measures the first step of each shape
for a goal's plan (:class:`~leakfree.offload.measure.StepMeasure`) and, under a limit,
checks the step after a new plan against it. The front calls it with its lock held.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import torch

from leakfree.offload.link import Link
from leakfree.offload.measure import StepMeasure
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

    def link(self, nbytes: int) -> Link: ...


__all__ = ["Measurer"]


class Measurer:
    """A goal's measured and checked steps (see the module doc): the step being measured
    (:attr:`measuring`: until its backward ends) and, under a limit, what the device held
    as the step checked against it began. Events and numbers only. Called under the
    manager's lock."""

    def __init__(self, planner: Planner, transfers: Copies, stats: OffloadStats) -> None:
        self._planner = planner
        self._transfers = transfers
        self._stats = stats
        self.measuring: StepMeasure | None = None
        self._checking: int | None = None
        self._plain_wait = transfers.wait  # restored when a measured step ends

    def reset(self) -> None:
        """The options changed: nothing measured or checked so far counts."""
        self._measure(None)
        self._checking = None

    def _measure(self, step: StepMeasure | None) -> None:
        """``step`` is the one measured now (None: none); its waits for copies are timed."""
        self.measuring = step
        self._transfers.wait = step.wait if step is not None else self._plain_wait

    def begin_forward(self) -> None:
        """A forward begins: measured, if a goal has no plan; under a limit, watched (where
        the device reports its peak): checked, if the plan is new; else corrected if it
        holds more than the limit (lengths the plan was not made for)."""
        planner = self._planner
        transfers = self._transfers
        if planner.mode.goal and planner.split is None:
            device = cast(torch.device, transfers.device)
            self._measure(StepMeasure(device, transfers.module, self._stats.to_host_bytes))
        elif planner.mode is Mode.LIMIT and transfers.module is not None:
            module = transfers.module
            module.reset_peak_memory_stats(transfers.device)
            self._checking = int(module.memory_allocated(transfers.device))

    def forward_ended(self, sizes: tuple[int, ...]) -> None:
        """A forward of other shapes than the plan's ended (``sizes``: its copies'): the
        measured step's forward is done; any other makes the next step a measured one."""
        measuring = self.measuring
        if measuring is not None and measuring.sizes is None:
            measuring.forward_done(sizes)
        else:
            self._planner.forget()
            self._measure(None)
            self._checking = None  # the plan it would check is gone

    def outgrown(self) -> None:
        """The plan was made again for a forward of larger lengths (it ran under the old
        one): this step is not its check; the next of these lengths is."""
        self._checking = None

    def pass_ended(self) -> None:
        """A backward pass is over: the measured step's makes the plan for its shapes (one
        host wait, for its last mark, and the bandwidth probe once); the checked step's
        peak is weighed by the planner."""
        measuring = self.measuring
        if measuring is not None and measuring.backward is not None:
            self._measure(None)
            measured = measuring.finish(self._stats.to_host_bytes, self._transfers.link)
            if measured is None:  # saves the plan did not see: the next step is measured
                return
            measurement, rises = measured
            planner = self._planner
            planner.adopt(measurement, measuring.allocated, checkable=measuring.module is not None)
            planner.rises = rises
            planner.replans += 1
            self._release_cache()
        elif self._checking is not None:
            self._checking = None
            module, device = self._transfers.module, self._transfers.device
            held = getattr(module, "max_memory_reserved", module.max_memory_allocated)
            planner = self._planner
            if planner.check is not None:
                planner.checked(int(held(device)))
            else:
                planner.overshot(int(held(device)))
            if planner.check is not None:  # a new plan, to be checked in turn
                self._release_cache()

    def _release_cache(self) -> None:
        """A new plan: what the caching allocator keeps of the steps before it (blocks
        laid out for another plan, or for a measured step that kept everything) goes back
        to the device, so that what the device holds from now on is the plan's. (On
        CUDA, ``empty_cache`` waits for the device: once per plan.)"""
        empty = getattr(self._transfers.module, "empty_cache", None)
        if empty is not None:
            empty()
