"""What stays on the device during forward: a budget's held and kept copies, and the small
storages the automatic budget keeps.

:class:`Keeper` ("the keeper") is the part of :class:`~leakfree.offload.OffloadActivations`
that decides, per saved storage, whether it moves now (through
:class:`~leakfree.offload.transfers.Transfers`), is held on the device (and moved later if
the budget is exceeded) or stays as it is, as the
:class:`~leakfree.offload.plan.Planner`'s split says. The front calls it with its lock held.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any, Protocol

import torch

from leakfree.offload.handles import _Forward, _Group, _HostCopy, _Kept
from leakfree.offload.options import Mode
from leakfree.offload.plan import Planner
from leakfree.offload.stats import OffloadStats


class Mover(Protocol):
    """What the keeper asks of the copies (:class:`~leakfree.offload.transfers.Transfers`,
    handed in by the front)."""

    def copy_out(
        self, t: torch.Tensor, copy: _HostCopy, ref: weakref.ref[_HostCopy], capacity: int
    ) -> None: ...

    def send(self, group: _Group) -> None: ...

    def open_groups(self) -> list[_Group]: ...


class Keeper:
    """What stays on the device (see the module doc).

    Kept here, weakly or as numbers: the copies a budget holds on the device (their
    device tensors are held by the copies, which the graph owns), the handles of a
    forward whose plan moves nothing, and their bytes. Nothing outlives the graphs."""

    def __init__(self, planner: Planner, transfers: Mover, stats: OffloadStats) -> None:
        self._planner = planner
        self._transfers = transfers
        self._stats = stats
        #: a budget's copies held on the device (weakly, oldest first, with sizes) and
        #: their bytes
        self._held: deque[tuple[weakref.ref[_HostCopy], int]] = deque()
        self._held_bytes = 0
        #: a forward whose plan moves nothing keeps its saved tensors as they are: by
        #: storage, the handles kept of it (weakly: the storage is kept while one lives)
        #: with its bytes; the bytes kept; and whether this forward still does
        self._kept: list[tuple[list[weakref.ref[_Kept]], int]] = []
        self._kept_bytes = 0
        #: the plan moves nothing: the pack hook keeps each tensor as it is (:meth:`keep`)
        self.keep_all = False
        self._on_plan = False  #: this forward still follows the plan
        #: of the bytes the plan keeps for small storages, what this forward has not kept
        self._small_room = 0
        self._saved = 0  #: the bytes of this forward's copies so far

    # -- a forward's bounds -------------------------------------------------------------

    def begin_forward(self) -> None:
        """A forward begins: the small storages it may keep, and whether it follows the
        plan, start over; the held copies and kept storages whose graphs are gone no
        longer count."""
        planner = self._planner
        self._small_room = planner.small_kept[1]
        self._on_plan = True
        self._saved = 0
        split = planner.split
        self.keep_all = split is not None and split.moved == 0
        if self._held or self._kept:
            self._forget_dead()

    def end_forward(self) -> None:
        """A forward ended: the most it held on the device, in the stats."""
        held = self._held_bytes + self._kept_bytes
        self._stats.peak_held_bytes = max(self._stats.peak_held_bytes, held)

    # -- deciding, per saved storage ------------------------------------------------------

    def small_stays(self, forward: _Forward, key: tuple[int, int, int]) -> bool:
        """Whether a storage under the plan's ``small_below`` (``key``: its address,
        version and bytes) stays where it is: while ``forward``'s small storages fit in the
        bytes the plan kept for them. A forward of other shapes may save more, or its
        activations may have shrunk under the mark: what does not fit moves, and the
        forward's copies then differ from the plan, which makes a new one."""
        small = forward.small
        if key not in small:  # saved again (another view, another node): counted once
            if key[2] > self._small_room:
                return False
            self._small_room -= key[2]
            small[key] = key[2]
        return True

    def keep(self, forward: _Forward, t: torch.Tensor, key: tuple[int, int, int]) -> Any:
        """A forward whose plan moves nothing: ``t`` stays as any kept tensor does, with no
        copy object, while the bytes kept fit the budget (None past it: the rest of the
        forward is handled as under any budget, the kept bytes a floor nothing moves).
        Counted by storage (``key``: address, version, bytes), as the plan counts its
        copies: a storage saved by several nodes counts once, a view counts its whole
        storage."""
        refs = forward.kept.get(key)
        if refs is None:
            if self._kept_bytes + key[2] > self._budget():
                self.keep_all = self._on_plan = False  # outgrown: held and moved
                return None
            self._kept_bytes += key[2]
            refs = forward.kept[key] = []
            self._kept.append((refs, key[2]))
        kept = _Kept(t)
        refs.append(weakref.ref(kept))  # the storage is kept while one of them lives
        # a record like a copy's: inside one ``with`` around many steps, a forward whose
        # graphs were dropped without backward ends once most of what it kept has died
        forward.record(kept)
        return kept

    def place(
        self, forward: _Forward, copy: _HostCopy, t: torch.Tensor, ref: weakref.ref[_HostCopy]
    ) -> None:
        """A new host ``copy`` of ``t``'s storage (``ref``: a weak reference to it), the
        latest of ``forward``'s copies: moved at once, or held, as the plan says."""
        planner = self._planner
        capacity = planner.capacity
        if planner.split is None and planner.mode is Mode.AUTO:
            self._transfers.copy_out(t, copy, ref, capacity)  # a first forward: all move
            return
        split = planner.split
        i = len(forward.sizes) - 1  # this copy's place in the forward
        self._saved += copy.nbytes
        planner.follow(i, self._saved)
        # By place, not by size: a forward of other lengths (packed or bucketed batches)
        # saves the same tensors in the same order, each of its own size.
        if self._on_plan and split is not None and i < len(split.sizes):
            if i < split.moved:  # the plan moves it: at once, as the forward goes
                self._transfers.copy_out(t, copy, ref, capacity)
                if planner.mode is Mode.BUDGET:
                    self._within_budget()
                return
        else:
            self._on_plan = False  # more than the plan saw: hold, and move the oldest
        self._hold(copy, t, ref, capacity)

    def _hold(
        self, copy: _HostCopy, t: torch.Tensor, ref: weakref.ref[_HostCopy], capacity: int
    ) -> None:
        """Hold ``copy`` on the device; then move the oldest held copies until the held
        bytes fit the budget again, and send the open groups if their bytes, still on the
        device, do not fit beside them."""
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
            self._transfers.copy_out(held, old, old_ref, capacity)
        self._within_budget()

    def _within_budget(self) -> None:
        """Under a device budget, send the open groups if their bytes (still on the device)
        and the held and kept ones pass it. (Without one, what the plan keeps is only
        what prefetch would bring back anyway: a group is sent when full.)"""
        total = self._held_bytes + self._kept_bytes
        if self._planner.mode is Mode.BUDGET:
            groups = self._transfers.open_groups()
            unsent = sum(group.used for group in groups)
            if total + unsent > self._budget():
                for group in groups:
                    self._transfers.send(group)
            else:
                total += unsent
        self._stats.peak_held_bytes = max(self._stats.peak_held_bytes, total)

    def _forget_dead(self) -> None:
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
