"""The stream policy: which device tensors stay while their copy is in flight, what one
backward pass keeps and brings back ahead of time, and what a device budget keeps.

Everything here is plain Python over weak references, tested on CPU: it owns no payload,
so dropping a graph is never delayed by it.

Prefetch follows the order backward actually used: a pass records the order in which it
first unpacked each group of host copies, and each copy a plan held on the device (by the
creation number of the copy it unpacked first); the next pass over a forward of the same
structure (every recorded creation number, relative to the first, names a live copy: the
sizes may differ, as a forward of other lengths saves the same tensors, each of its own
size, and so may the grouping) prefetches its groups in that order, within a byte window.
A pass with no matching record prefetches nothing: nothing is brought back that backward
will not use.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from leakfree.offload.handles import _Group, _HostCopy

#: one device-to-host copy in flight: the device tensor it reads (held here, so it outlives
#: even a graph dropped mid-forward), the event of its group's copies, and its bytes
Flight = tuple[torch.Tensor, Any, int]


class _Copies:
    """The live host copies a manager made, weakly, by creation number (``copy.seq``).

    The dead are dropped whenever the entries double since the last time (amortised: one
    sweep per as many additions as it keeps), so there are at most about twice as many
    entries as live copies, however long the run and whatever a graph kept alive."""

    __slots__ = ("count", "mark", "refs")

    def __init__(self) -> None:
        self.refs: dict[int, weakref.ref[_HostCopy]] = {}  # in creation order
        self.count = 0  # copies made
        self.mark = _SWEEP_SLACK  # the entries at which the dead are swept next

    def next_seq(self) -> int:
        return self.count

    def add(self, copy: _HostCopy) -> weakref.ref[_HostCopy]:
        """Number ``copy`` (``copy.seq``) and keep it, weakly; returns the weak reference
        (the one a copy needs: it serves every other holder too)."""
        seq = copy.seq = self.count
        self.count += 1
        ref = self.refs[seq] = weakref.ref(copy)
        if len(self.refs) > self.mark:
            self.refs = {s: r for s, r in self.refs.items() if r() is not None}
            self.mark = 2 * len(self.refs) + _SWEEP_SLACK
        return ref

    def at(self, seq: int) -> _HostCopy | None:
        ref = self.refs.get(seq)
        return ref() if ref is not None else None


#: entries _Copies keeps beyond twice its live ones
_SWEEP_SLACK = 64


#: the order one pass first unpacked its groups and held copies: the creation number of
#: each (a group's: its first copy's), relative to the first one unpacked, in unpack order
Order = tuple[int, ...]

#: what a pass unpacks: a group brought back, or a copy a device budget held
Unit = _Group | _HostCopy


class _Pass:
    """One backward pass (one graph task) through a manager's groups of host copies."""

    __slots__ = (
        "early",
        "early_queue",
        "following",
        "held",
        "next",
        "order",
        "outstanding",
        "position",
        "prefetched",
        "window",
    )

    def __init__(self) -> None:
        self.order: list[int] = []  # creation numbers, in first-unpack order
        self.held: list[weakref.ref[_Group]] = []  # groups given a `keep` in this pass
        self.prefetched: list[weakref.ref[_Group]] = []
        self.outstanding = 0  # bytes prefetched and not consumed yet
        self.following: list[weakref.ref[Unit]] = []  # the learned order, this pass's units
        self.position: dict[int, int] = {}  # seq -> index in plan
        self.next = 0  # the first plan index not yet considered for prefetch
        #: the default prefetch window: twice the plan's largest copy (so about two copies
        #: ahead, as many as fit in whole groups; one group at least)
        self.window = 0
        #: the groups brought back early, as the pass began (a goal's plan): None until then
        self.early: set[int] | None = None
        #: the groups still to bring back early, in the order sent
        self.early_queue: list[weakref.ref[_Group]] = []

    def learned(self) -> Order:
        """This pass's order, relative to its first unpacked unit (empty if none)."""
        if not self.order:
            return ()
        first = self.order[0]
        return tuple([seq - first for seq in self.order])


def _follow(order: Order, first: _HostCopy, copies: _Copies, state: _Pass) -> None:
    """Set ``state``'s plan from ``order`` if this pass's copies match it: ``first`` (the
    copy first unpacked) stands where the recorded first one did, and every recorded copy
    is alive. Each names its unit now: its group (once, where it is first named), or
    itself where it is held on the device. Sizes may differ, and so may the grouping: a
    forward of other lengths (packed or bucketed batches) saves the same tensors in the
    same order, each of its own size, and a plan that moves other copies groups them
    otherwise (the step after a measured one that kept or moved everything)."""
    if not order:
        return
    base = first.seq - order[0]  # the creation number of relative 0
    plan: list[weakref.ref[Unit]] = []
    position: dict[int, int] = {}
    seen: set[int] = set()
    largest = 0
    for rel in order:
        copy = copies.at(base + rel)
        if copy is None:
            return
        group = copy.group
        unit: Unit = copy if group is None else group
        if group is not None:
            if id(group) in seen:
                continue
            seen.add(id(group))
            largest = max(largest, group.largest)
        position[unit.seq] = len(plan)
        plan.append(weakref.ref(unit))
    state.following = plan
    state.position = position
    state.window = 2 * largest


def _to_prefetch(state: _Pass, current: Unit, window: int) -> list[_Group]:
    """The groups to bring back now, after ``current``: the next ones in the plan that are
    sent and not restored, prefetched or kept, while the bytes outstanding stay within
    ``window`` (one at least, so a group larger than the window still comes early). Adds
    them to ``state.outstanding``. Held copies in the plan are passed over."""
    i = state.position.get(current.seq)
    if i is None:
        return []
    out: list[_Group] = []
    j = max(i + 1, state.next)
    plan = state.following
    while j < len(plan):
        group = plan[j]()
        if (
            not isinstance(group, _Group)
            or group.block is None
            or group.prefetched is not None
            or (group.keep is not None and group.task == current.task)
            or (group.restored is not None and group.restored[0]() is not None)
        ):
            j += 1
            continue
        if state.outstanding and state.outstanding + group.used > window:
            break
        state.outstanding += group.used
        out.append(group)
        j += 1
    state.next = j
    return out
