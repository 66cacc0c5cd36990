"""The stream policy: which device tensors stay while their copy is in flight, what one
backward pass keeps and brings back ahead of time, and what a device budget keeps.

Everything here is plain Python over weak references, tested on CPU: it owns no payload,
so dropping a graph is never delayed by it.

Prefetch follows the order backward actually used: a pass records the order in which it
first unpacked each copy (by creation number, with sizes); the next pass over a forward
of the same shape (every recorded creation number, relative to the first, names a live
copy of the same size) prefetches in that order, within a byte window. A pass with no
matching record prefetches nothing: nothing is brought back that backward will not use.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from leakfree.offload.handles import _HostCopy, _Offloaded

#: one device-to-host copy in flight: its handle (weakly), the device tensor it reads
#: (held here, so it outlives even a graph dropped mid-forward) and the copy's event
Flight = tuple[weakref.ref[_Offloaded], torch.Tensor, Any]


class _Copies:
    """Every copy a manager made, weakly, by creation number (``copy.seq``); the dead
    prefix is dropped as it grows, so a long run stays cheap."""

    __slots__ = ("base", "refs")

    def __init__(self) -> None:
        self.refs: deque[weakref.ref[_HostCopy]] = deque()
        self.base = 0  # creation number of refs[0]

    def next_seq(self) -> int:
        return self.base + len(self.refs)

    def add(self, copy: _HostCopy) -> None:
        """Number ``copy`` (``copy.seq``) and keep it, weakly."""
        copy.seq = self.base + len(self.refs)
        self.refs.append(weakref.ref(copy))
        if len(self.refs) >= 4096 and self.refs[0]() is None:
            while self.refs and self.refs[0]() is None:
                self.refs.popleft()
                self.base += 1

    def at(self, seq: int) -> _HostCopy | None:
        i = seq - self.base
        return self.refs[i]() if 0 <= i < len(self.refs) else None


#: the order one pass first unpacked its copies: (creation number relative to the first
#: one unpacked, size in bytes), in unpack order
Order = tuple[tuple[int, int], ...]


class _Pass:
    """One backward pass (one graph task) through a manager's copies."""

    __slots__ = (
        "held",
        "next",
        "order",
        "outstanding",
        "plan",
        "position",
        "prefetched",
        "window",
    )

    def __init__(self) -> None:
        self.order: list[tuple[int, int]] = []  # (seq, nbytes), in first-unpack order
        self.held: list[weakref.ref[_HostCopy]] = []  # copies given a `keep` in this pass
        self.prefetched: list[weakref.ref[_HostCopy]] = []
        self.outstanding = 0  # bytes prefetched and not consumed yet
        self.plan: list[weakref.ref[_HostCopy]] = []  # the learned order, as copies
        self.position: dict[int, int] = {}  # seq -> index in plan
        self.next = 0  # the first plan index not yet considered for prefetch
        self.window = 0  # the default prefetch window: twice the plan's largest copy

    def learned(self) -> Order:
        """This pass's order, relative to its first unpacked copy (empty if none)."""
        if not self.order:
            return ()
        first = self.order[0][0]
        return tuple([(seq - first, nbytes) for seq, nbytes in self.order])


def _follow(order: Order, first: _HostCopy, copies: _Copies, state: _Pass) -> None:
    """Set ``state``'s plan from ``order`` if this pass's copies match it: ``first`` (the
    first copy unpacked) stands where the recorded first one did, and every recorded copy
    is alive with the recorded size."""
    if not order or order[0][1] != first.nbytes:
        return
    base = first.seq - order[0][0]  # the creation number of relative 0
    plan: list[weakref.ref[_HostCopy]] = []
    largest = 0
    for rel, nbytes in order:
        copy = copies.at(base + rel)
        if copy is None or copy.nbytes != nbytes:
            return
        plan.append(weakref.ref(copy))
        largest = max(largest, nbytes)
    state.plan = plan
    state.position = {base + rel: i for i, (rel, _) in enumerate(order)}
    state.window = 2 * largest


def _to_prefetch(state: _Pass, current: _HostCopy, window: int) -> list[_HostCopy]:
    """The copies to bring back now, after ``current``: the next ones in the plan that are
    on the host and not restored, prefetched or kept, while the bytes outstanding stay
    within ``window`` (one at least, so a copy larger than the window still comes early).
    Adds them to ``state.outstanding``."""
    i = state.position.get(current.seq)
    if i is None:
        return []
    out: list[_HostCopy] = []
    j = max(i + 1, state.next)
    plan = state.plan
    while j < len(plan):
        copy = plan[j]()
        if (
            copy is None
            or copy.block is None
            or copy.prefetched is not None
            or (copy.keep is not None and copy.task == current.task)
            or (copy.restored is not None and copy.restored[0]() is not None)
        ):
            j += 1
            continue
        if state.outstanding and state.outstanding + copy.nbytes > window:
            break
        state.outstanding += copy.nbytes
        out.append(copy)
        j += 1
    state.next = j
    return out


@dataclass(frozen=True)
class OffloadPlan:
    """What a device budget keeps on the device and moves to the host, per forward: the
    plan made from the last forward whose saved tensors it saw (``budget``: bytes;
    ``kept`` / ``moved``: how many copies, by storage; ``*_bytes``: their sizes, so
    ``moved_bytes`` go to the host in forward and back in backward). ``replans``: how
    many times a forward of another shape made a new plan."""

    budget: int
    kept: int
    kept_bytes: int
    moved: int
    moved_bytes: int
    replans: int

    def __str__(self) -> str:
        from leakfree._text import format_bytes

        return (
            f"device budget {format_bytes(self.budget)}: {self.kept} saved tensors "
            f"({format_bytes(self.kept_bytes)}) stay on the device, {self.moved} "
            f"({format_bytes(self.moved_bytes)}) go to the host and back; "
            f"{self.replans} re-plan(s)"
        )


def _plan(sizes: list[int], budget: int) -> int:
    """How many of ``sizes`` (a forward's copies, in creation order) move: the earliest
    ones, which backward needs last. The kept ones are the latest that fit in ``budget``
    together; the first that does not fit, and all before it, move."""
    kept = 0
    for i in range(len(sizes) - 1, -1, -1):
        if kept + sizes[i] > budget:
            return i + 1
        kept += sizes[i]
    return 0
