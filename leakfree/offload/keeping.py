"""What stays on the device during forward: a device budget's held and kept copies, the
small storages the automatic plan keeps, and a goal's plan from a measured step.

:class:`_Keeping` is the part of :class:`~leakfree.offload.OffloadActivations` that
decides, per saved storage, whether it moves now, is held (and moved later if the budget
is exceeded) or stays; the plan itself is the :class:`~leakfree.offload.plan.Planner`'s.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any, cast

import torch

import leakfree._args as _args
from leakfree.offload.handles import _Group, _HostCopy, _Kept
from leakfree.offload.measure import StepMeasure, bandwidth
from leakfree.offload.plan import OffloadPlan
from leakfree.offload.transfers import _Transfers

#: ``device_budget``'s automatic value (None means the same)
AUTO = "auto"


#: what an explicit device budget or a goal decides for itself: (option, what it does)
_OVERRIDDEN = {
    "keep_small": "keeps the smallest storages",
    "max_fwd_stash_size": "bounds the copies in flight that hold their device tensors",
}


def _check_device_budget(name: str | None, value: object) -> int | None:
    """The one check of ``device_budget``, at construction and on assignment: the bytes,
    or None for the automatic budget (``"auto"``, or None)."""
    if value == AUTO and isinstance(value, str):
        return None
    call = "OffloadActivations" if name else "OffloadActivations.device_budget"
    return _args.count(  # type: ignore[no-any-return]
        call, name, value, 0, none=True, unit='bytes of saved activations to keep, or "auto"'
    )


def _refuse_overridden(decider: str, given: dict[str, Any]) -> None:
    """An explicit device budget or a goal decides what stays on the device and lets moved
    tensors go at once: the options that do so without one are refused with it."""
    for option, value in given.items():
        if value is not None:
            raise _args.ArgumentError(
                f"OffloadActivations({decider}=..., {option}={value!r}): {option} "
                f"{_OVERRIDDEN[option]} under the automatic budget only; with {decider} it "
                f"would be ignored: leave {option} out"
            )


def _check_max_overhead(name: str | None, value: object) -> None:
    """The one check of ``max_overhead``, at construction and on assignment."""
    if value is not None:
        call = "OffloadActivations" if name else "OffloadActivations.max_overhead"
        _args.number(call, name, value, 0.0)


def _check_device_limit(name: str | None, value: object) -> None:
    """The one check of ``device_limit``, at construction and on assignment."""
    call = "OffloadActivations" if name else "OffloadActivations.device_limit"
    _args.count(call, name, value, 0, none=True, unit="bytes the step may allocate on the device")


def _check_keep_small(name: str | None, value: object) -> None:
    """The one check of ``keep_small``, at construction and on assignment."""
    _args.flag("OffloadActivations" if name else "OffloadActivations.keep_small", name, value)


class _Keeping(_Transfers):
    """What stays on the device, and the plans (see the module doc)."""

    # -- the settings (the planner's) -------------------------------------------------

    @property
    def batch_bytes(self) -> int:
        """Copies smaller than this share a host block and a transfer (see the class)."""
        return self._planner.batch_bytes

    @property
    def device_budget(self) -> int | str:
        """Bytes of saved activations to keep on the device, or ``"auto"`` (settable: the
        next forward then plans again, as a first forward does)."""
        budget = self._planner.device_budget
        return AUTO if budget is None else budget

    @device_budget.setter
    def device_budget(self, value: int | str | None) -> None:
        budget = _check_device_budget(None, value)
        if budget is not None and self._planner.goal:
            raise _args.ArgumentError(
                f"OffloadActivations.device_budget = {value!r}: max_overhead or "
                "device_limit is set; set them to None first"
            )
        self._set("device_budget", budget)

    @property
    def max_overhead(self) -> float | None:
        """The step time offloading may add, a fraction of the step's compute (settable:
        the next step is measured and planned again)."""
        return self._planner.max_overhead

    @max_overhead.setter
    def max_overhead(self, value: float | None) -> None:
        _check_max_overhead(None, value)
        self._no_budget_with_goal(value)
        self._set("max_overhead", value)

    @property
    def device_limit(self) -> int | None:
        """Bytes the step may allocate on the device (settable: the next step is measured
        and planned again)."""
        return self._planner.device_limit

    @device_limit.setter
    def device_limit(self, value: int | None) -> None:
        _check_device_limit(None, value)
        self._no_budget_with_goal(value)
        self._set("device_limit", value)

    def _no_budget_with_goal(self, value: object) -> None:
        if value is not None and self._planner.device_budget is not None:
            raise _args.ArgumentError(
                "OffloadActivations: a goal (max_overhead, device_limit) with a "
                'device_budget set: set device_budget = "auto" first'
            )

    @property
    def keep_small(self) -> bool:
        """Whether the plan keeps the smallest saved storages on the device (settable: the
        next forward then plans again, as a first forward does)."""
        return self._planner.keep_small

    @keep_small.setter
    def keep_small(self, value: bool) -> None:
        _check_keep_small(None, value)
        planner = self._planner
        if planner.device_budget is not None or planner.goal:
            raise _args.ArgumentError(
                f"OffloadActivations.keep_small = {value!r}: keeps the smallest storages "
                "under the automatic budget only; device_budget or a goal is set"
            )
        self._set("keep_small", value)

    def _set(self, name: str, value: object) -> None:
        """Set the planner's ``name`` (checked); a change makes the next forward plan, or
        be measured, again, as a first forward is."""
        planner = self._planner
        with self._lock:
            if value != getattr(planner, name):
                planner.forget()
                self._measuring = None
                self._checking = None
            setattr(planner, name, value)
            self._window = self.use_streams and planner.device_budget is None and not planner.goal

    # -- deciding, per saved storage ------------------------------------------------

    def _small_stays(self, key: tuple[int, int, int]) -> bool:
        """Whether a storage under the plan's ``_small_below`` (``key``: its address,
        version and bytes) stays where it is: while this forward's small storages fit in
        the bytes the plan kept for them. A forward of other shapes may save more, or its
        activations may have shrunk under the mark: what does not fit moves, and the
        forward's copies then differ from the plan, which makes a new one. (Forward-only
        state, reset by ``__enter__`` and read by ``_end_forward``.)"""
        small = self._forward.small
        if key not in small:  # saved again (another view, another node): counted once
            if key[2] > self._small_room:
                return False
            self._small_room -= key[2]
            small[key] = key[2]
        return True

    def _budgeted(self, copy: _HostCopy, t: torch.Tensor, ref: weakref.ref[_HostCopy]) -> None:
        """Keep ``copy`` on the device or move it, as the plan says; then move the oldest
        held copies until the held bytes fit the budget again, and send the open groups if
        their bytes, still on the device, do not fit beside them."""
        plan = self._planner.plan
        i = len(self._forward.sizes) - 1  # this copy's place in the forward
        if self._on_plan and plan is not None and i < len(plan[0]) and plan[0][i] == copy.nbytes:
            if i < plan[1]:  # the plan moves it: at once, as the forward goes
                self._copy_out(t, copy, ref)
                if self._planner.device_budget is not None:
                    self._within_budget()
                return
        else:
            self._on_plan = False  # another shape: hold, and move the oldest as needed
        copy.pending = t.detach()
        self._held.append((ref, copy.nbytes))
        self._held_bytes += copy.nbytes
        budget = self._budget() - self._kept_bytes
        while self._held_bytes > budget and self._held:
            old_ref, nbytes = self._held.popleft()
            self._held_bytes -= nbytes
            old = old_ref()
            if old is None or old.pending is None:
                continue
            held = old.pending
            if held._version != old.version:
                continue  # written in place since: its unpack reports it, as PyTorch would
            old.pending = None
            self._copy_out(held, old, old_ref)
        self._within_budget()

    def _within_budget(self) -> None:
        """Under a device budget, send the open groups if their bytes (still on the device)
        and the held and kept ones pass it. (Without one, what the plan keeps is only
        what prefetch would bring back anyway: a group is sent when full.)"""
        total = self._held_bytes + self._kept_bytes
        budget = self._planner.device_budget
        if budget is not None:
            groups = self._open_groups()
            unsent = sum(group.used for group in groups)
            if total + unsent > budget:
                for group in groups:
                    self._send(group)
            else:
                total += unsent
        self.stats.peak_held_bytes = max(self.stats.peak_held_bytes, total)

    def _open_groups(self) -> list[_Group]:
        """The groups waiting to be sent, oldest first (lock held)."""
        groups = []
        for ref in self._open.values():
            group = ref()
            if group is not None:
                groups.append(group)
        return groups

    def _keep(self, t: torch.Tensor, key: tuple[int, int, int]) -> Any:
        """A forward whose plan moves nothing: ``t`` stays as any kept tensor does, with no
        copy object, while the bytes kept fit the budget; past it, the rest of the forward
        is handled as under any budget, the kept bytes a floor nothing moves. Counted by
        storage (``key``: address, version, bytes), as the plan counts its copies: a
        storage saved by several nodes counts once, a view counts its whole storage."""
        with self._lock:
            forward = self._forward
            refs = forward.kept.get(key)
            if refs is None:
                if self._kept_bytes + key[2] > self._budget():
                    self._keep_all = self._on_plan = False  # outgrown: held and moved
                    return None
                self._kept_bytes += key[2]
                refs = forward.kept[key] = []
                self._kept.append((refs, key[2]))
            kept = _Kept(t)
            refs.append(weakref.ref(kept))  # the storage is kept while one of them lives
            forward.record(kept)
            return kept

    def _forget_dead_held(self) -> None:
        """Drop the held copies whose graph is gone (used, or dropped) from the count."""
        live = deque(e for e in self._held if (c := e[0]()) is not None and c.pending is not None)
        self._held = live
        self._held_bytes = sum(n for _, n in live)
        # an earlier forward's, still kept by its graph
        kept = [e for e in self._kept if any(r() is not None for r in e[0])]
        self._kept = kept
        self._kept_bytes = sum(n for _, n in kept)

    def _budget(self) -> int:
        """The bytes of saved activations this forward keeps on the device (the planner's
        budget: see :meth:`Planner.budget`)."""
        return self._planner.budget(on_plan=self._on_plan)

    def _end_forward(self) -> None:
        """A forward ended: plan the next from its copy sizes, unless it followed the plan
        (a goal's plan is made once the step is measured, at the end of its backward; a
        forward of other shapes makes the next one measured)."""
        forward = self._forward
        sizes, spans, small = forward.sizes, forward.spans, forward.small
        planner = self._planner
        if not sizes or (planner.plan is not None and tuple(sizes) == planner.plan[0]):
            return
        if planner.goal:
            measuring = self._measuring
            if measuring is not None and measuring.sizes is None:
                measuring.forward_done(tuple(sizes))
            else:
                planner.forget()
                self._measuring = None
            return
        # each copy's storage bytes (a span's storage may be larger than the span), and
        # every storage the forward saved, once: whole copies are one per storage (the
        # dedup map), spans of one storage or of a storage copied whole count once more
        storages = [spans[i][2] if i in spans else n for i, n in enumerate(sizes)]
        shared = forward.shared
        saved = [n for i, n in enumerate(sizes) if i not in spans]
        saved += [key[2] for key in set(spans.values()) if key[:2] not in shared]
        saved += small.values()
        planner.from_forward(sizes, storages, saved)

    @property
    def plan(self) -> OffloadPlan | None:
        """What stays on the device and what moves per forward, and what a goal's plan
        predicts (None before the first forward ends, or a goal's first step)."""
        return self._planner.report()

    def _plan_measured(self, measuring: StepMeasure) -> None:
        """The measured step's backward is over (lock held): the plan for its shapes, from
        what it measured (one host wait, for its last mark, and the bandwidth probe once)."""
        self._measuring = None
        measured = measuring.finish(self.stats.to_host_bytes, self._probe)
        if measured is None:  # saves the plan did not see: the next step is measured
            return
        measurement, rises = measured
        planner = self._planner
        checkable = measuring.module is not None
        planner.adopt(measurement, measuring.allocated, checkable=checkable)
        planner.rises = rises
        planner.replans += 1

    def _probe(self, nbytes: int) -> tuple[float, float]:
        """The copy bandwidths each way (measured once, with ``nbytes``)."""
        if self._bandwidth is None:
            module = self._device_module
            device = cast(torch.device, self.device)
            if module is not None and self.use_streams:
                streams = (self._side(device, False), self._side(device, True))
            elif module is not None:
                current = module.current_stream(device)
                streams = (current, current)
            else:
                streams = (None, None)
            self._bandwidth = bandwidth(device, module, streams, nbytes)
        return self._bandwidth

    def _check_start(self) -> None:
        """A step under a limit's new plan begins (lock held): its peak is read at its end."""
        module, device = self._device_module, self.device
        module.reset_peak_memory_stats(device)
        self._checking = int(module.memory_allocated(device))

    def _check_end(self) -> None:
        """The checked step is over (lock held): the planner weighs its peak."""
        self._checking = None
        self._planner.checked(int(self._device_module.max_memory_allocated(self.device)))
