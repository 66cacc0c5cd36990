"""Backward passes through a manager's host copies: each group brought back once per
pass and kept until its last handle is unpacked, prefetch in the order the previous pass
used, and a goal's early copies back while the last copies out still run.

:class:`Backward` ("the passes") is the part of
:class:`~leakfree.offload.OffloadActivations` that unpacks: the handles the graph owns call
it (weakly), and the engine's end-of-pass callback; :mod:`leakfree.offload.streams` has the
order's bookkeeping.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Protocol

import torch

from leakfree._allocator import Counts
from leakfree.offload.handles import Arrival, _Group, _HostCopy, _Offloaded
from leakfree.offload.measure import StepMeasure
from leakfree.offload.plan import Planner
from leakfree.offload.pool import HostBlockPool
from leakfree.offload.streams import Order, _Copies, _follow, _Pass, _to_prefetch


class Copier(Protocol):
    """What the passes ask of the copies (:class:`~leakfree.offload.transfers.Transfers`,
    handed in by the front)."""

    use_streams: bool
    pool: HostBlockPool

    def send(self, group: _Group) -> None: ...

    def copy_in(
        self, group: _Group, *, prefetch: bool = False
    ) -> tuple[torch.Tensor, Arrival | None]: ...

    def use_here(self, dev: torch.Tensor, arrival: Arrival) -> None: ...

    read: Callable[[], Counts] | None


class Sampler(Protocol):
    """What the passes tell the measurer (:class:`~leakfree.offload.measurer.Measurer`):
    the step it measures, if any, samples backward; a pass that ends ends its step."""

    measuring: StepMeasure | None

    def pass_ended(self) -> None: ...


#: the backward pass running on this thread (-1 outside one), and the engine's "run this
#: when the pass is over"
graph_task: Callable[[], int] = torch._C._current_graph_task_id
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


class Backward:
    """Backward's side of the copies (see the module doc).

    Kept here: the state of the passes under way (until each ends), the order the last
    finished pass used (creation numbers and sizes), and weak references to the live host
    copies by creation number. Called under the manager's ``lock``: backward may unpack
    on several device threads."""

    def __init__(
        self,
        transfers: Copier,
        planner: Planner,
        measurer: Sampler,
        lock: threading.RLock,
        prefetch_bytes: int | None,
    ) -> None:
        self._transfers = transfers
        self._planner = planner
        self._measurer = measurer
        self._lock = lock
        #: how many bytes a pass may have brought back ahead of their use (None: twice
        #: the largest group the pass will bring back)
        self.prefetch_bytes = prefetch_bytes
        self.copies = _Copies()  #: the live host copies, by creation number
        #: backward passes under way (graph task id -> its state), and the order the last
        #: finished pass used, which the next pass of the same shape prefetches in
        self._passes: dict[int, _Pass] = {}
        self._order: Order = ()
        self.began = 0  #: passes begun: a forward record ends at a save after one began
        self.ref = weakref.ref(self)  #: what the handles hold

    def restore(self, handle: _Offloaded) -> torch.Tensor:
        """``handle``'s tensor on the device, viewing its group's device tensor: the one
        this pass keeps, a live restored one, the prefetched one, or a new copy in.

        Runs for every unpacked handle: the pass's bookkeeping is written out here rather
        than in helpers, but for a group's first unpack in a pass (:meth:`_first_unpack`).
        The restored tensor is kept (``group.keep``) until the last handle of the group's
        copies has been unpacked."""
        copy = handle.copy
        group = copy.group
        if group is None:  # unreachable: a handle without a group is held on the device
            raise RuntimeError("leakfree: an offloaded tensor has no host copy; please report this")
        task = graph_task()
        with self._lock:
            if group.block is None:  # needed before its forward ended: send it now
                self._transfers.send(group)
            state = None
            if task >= 0:
                state = self._passes.get(task) or self._pass(task, copy)
            kept = group.keep if group.task == task else None
            if kept is not None:
                dev = kept
            else:
                sibling = group.live_restored() if group.restored is not None else None
                if sibling is not None:  # a sibling's, from another pass: maybe another stream
                    dev, arrival = sibling
                    if arrival is not None:
                        self._transfers.use_here(dev, arrival)
                else:
                    if group.prefetched is not None:
                        dev, arrival = group.prefetched
                        group.prefetched = None
                        early = state.early if state is not None else None
                        if state is not None and (early is None or group.seq not in early):
                            state.outstanding -= group.used
                        if arrival is not None:
                            self._transfers.use_here(dev, arrival)
                    else:
                        dev, found = self._transfers.copy_in(group)
                        arrival = found
                    # a later pass may find it alive (a double-backward graph keeps it)
                    group.restored = (weakref.ref(dev.untyped_storage()), arrival)
            if state is not None:
                if group.task != task:  # the first unpack of this group in this pass
                    self._first_unpack(state, group, copy, task)
                if handle.task != task:
                    handle.task = task
                    group.remaining -= 1
                # One view per geometry while the pass keeps the group (a tensor saved by
                # several nodes: a view op, and its Python, for the first one only)
                views = group.views
                if group.remaining > 0:
                    group.keep = dev
                    if views is None:
                        views = group.views = {}
                else:  # its last handle: what it kept goes (after this last look)
                    group.keep = group.views = None
            else:
                views = None
            if handle.same and group.like is not None:  # the group's tensor is the handle's
                return dev
            if views is None:
                return handle.view_of(dev, copy.offset, False)
            key = (copy.offset, handle.element_offset, handle.shape, handle.stride, handle.dtype)
            out = views.get(key)
            if out is None:
                out = views[key] = handle.view_of(dev, copy.offset, False)
            return out

    def _first_unpack(self, state: _Pass, group: _Group, copy: _HostCopy, task: int) -> None:
        """Backward pass ``task`` unpacks ``group`` for the first time (lock held), for
        ``copy``: its place in the pass's order (by that copy), and what the learned order
        needs next, prefetched (a goal's early groups too)."""
        group.task = task
        group.remaining = group.users
        state.order.append(copy.seq)
        state.held.append(weakref.ref(group))
        measuring = self._measurer.measuring
        if measuring is not None:
            measuring.sample(group.used, moved=True)
        self._ahead(state, group)

    def _ahead(self, state: _Pass, unit: _Group | _HostCopy) -> None:
        """The pass first unpacks ``unit`` (a group brought back, or a copy held on the
        device): what the learned order needs next is brought back ahead, within the
        window (a goal's early groups too). A held copy starts it as well, so the first
        groups backward needs after the ones kept on the device are on their way while it
        uses those."""
        if not (state.following and self._transfers.use_streams):
            return
        planner = self._planner
        if planner.early:
            self._prefetch_early(state, unit)
        window = self.prefetch_bytes
        if window is None:
            window = state.window
            counts = self._transfers.read() if self._transfers.read is not None else None
            if planner.mode.goal and planner.split is not None and counts is not None:
                # a goal's plan looks further ahead where the device has room under its
                # ceiling (backward frees what it has used): copies back then run as early
                # as its schedule assumes, not a window's length before their use (the
                # bytes prefetched and not used yet are counted in the room already)
                room = planner.room(len(state.order) - 1, counts)
                window = max(window, room + state.outstanding)
        if window:
            for ahead in _to_prefetch(state, unit, window):
                ahead.prefetched = self._transfers.copy_in(ahead, prefetch=True)
                state.prefetched.append(weakref.ref(ahead))

    def _prefetch_early(self, state: _Pass, first: _Group | _HostCopy) -> None:
        """Bring back up to ``_early`` bytes of this pass's groups ahead of their turn
        (lock held; ``first``: what the pass is unpacking now): the ones sent first, whose
        copies out ended first (the forward's earliest activations, which backward needs
        last), in the order sent, so the copy back engine works while the last copies out
        run and never waits for a later one. Paced by what backward frees: each
        comes once the device leaves room for it (:meth:`Planner.room`), so the step's
        peak does not grow; they do not count against the prefetch window."""
        if state.early is None:  # the pass begins: its queue, once
            state.early = set()
            sent = [r() for r in state.following]
            chosen = [g for g in sent if isinstance(g, _Group) and g is not first and g.block]
            budget = self._planner.early
            for candidate in sorted(chosen, key=lambda g: g.sent):
                if candidate.used > budget:
                    break
                budget -= candidate.used
                state.early_queue.append(weakref.ref(candidate))
        queue = state.early_queue
        if not queue:
            return
        read = self._transfers.read
        if read is None:
            return
        room = self._planner.room(len(state.order) - 1, read())
        while queue:
            group = queue[0]()
            if group is not None and group.used > room:
                return  # no room yet: the next first unpack looks again
            queue.pop(0)
            if (
                group is None
                or group.prefetched is not None
                or group.block is None
                or (group.restored is not None and group.restored[0]() is not None)
            ):
                continue
            room -= group.used
            group.prefetched = self._transfers.copy_in(group, prefetch=True)
            state.prefetched.append(weakref.ref(group))
            state.early.add(group.seq)

    def note(self, copy: _HostCopy) -> None:
        """A copy held on the device was unpacked: its place in this pass's order (so the
        order of the next pass lines up, whichever copies it holds)."""
        task = graph_task()
        if task < 0 or copy.task == task:
            return
        with self._lock:
            state = self._pass(task, copy)
            copy.task = task
            state.order.append(copy.seq)
            measuring = self._measurer.measuring
            if measuring is not None:
                measuring.sample(copy.nbytes, moved=False)
            self._ahead(state, copy)

    def _pass(self, task: int, first: _HostCopy) -> _Pass:
        """The state of backward pass ``task`` (lock held); begun by its first unpack, of
        ``first``: it follows the order learned last time, and ends in a callback."""
        state = self._passes.get(task)
        if state is None:
            self.began += 1  # the next save outside a pass begins a new forward
            state = self._passes[task] = _Pass()
            measuring = self._measurer.measuring
            if measuring is not None:
                measuring.backward_begins()
            _follow(self._order, first, self.copies, state)
            _queue_callback(functools.partial(_pass_over, self.ref, task))
        return state

    def end_pass(self, task: int) -> None:
        """The pass is over: drop what it kept and prefetched, learn the order it used."""
        with self._lock:
            state = self._passes.pop(task, None)
            if state is None:
                return
            for ref in state.held:
                group = ref()
                if group is not None and group.task == task:
                    group.keep = group.views = None
            for ref in state.prefetched:
                group = ref()
                if group is not None and group.prefetched is not None:
                    # brought back and never used: freed in the current stream's order,
                    # after its copy (the memory is the current stream's)
                    dev, arrival = group.prefetched
                    group.prefetched = None
                    if arrival is not None:
                        self._transfers.use_here(dev, arrival)
            if state.order:
                self._order = state.learned()
            self._measurer.pass_ended()
        # between steps: the pool makes the blocks the next forward takes (outside it)
        self._transfers.pool.prepare()


def _pass_over(passes_ref: weakref.ref[Backward], task: int) -> None:
    """The engine's callback at the end of backward pass ``task`` (weakly: a manager
    dropped meanwhile has nothing to end)."""
    passes = passes_ref()
    if passes is not None:
        passes.end_pass(task)
