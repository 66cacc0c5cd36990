"""Copies between the device and the host: out in forward (a group at a time, on the out
side stream), back in backward (now, on the current stream, or ahead, on the prefetch
side stream), and what keeps their memory safe (the in-flight window, ``record_stream``,
the events the consumers wait on).

:class:`Transfers` ("the copies") is the part of
:class:`~leakfree.offload.OffloadActivations` that makes them: it owns the host block pool,
the side streams, the open groups and the in-flight window, and counts what it moves in the
manager's :class:`~leakfree.offload.stats.OffloadStats`. The front calls it with its lock
held.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any, cast

import torch

from leakfree._device import device_index
from leakfree.offload.handles import _Group, _HostCopy
from leakfree.offload.measure import bandwidth
from leakfree.offload.pool import HostBlock, HostBlockPool
from leakfree.offload.stats import OffloadStats
from leakfree.offload.streams import Flight


class Transfers:
    """The copies and their streams (see the module doc).

    Kept here: the pool's free host blocks (until the pool is trimmed or dies), the side
    streams, weak references to the open groups, and, with the in-flight window
    (``window``), the device tensors of the last ``stash`` copies out until they retire.
    Nothing else per step: the graph owns the groups and their blocks."""

    def __init__(
        self,
        device: torch.device | None,
        module: Any,
        *,
        use_streams: bool,
        pool: HostBlockPool,
        stats: OffloadStats,
        window: bool,
        stash: int,
    ) -> None:
        self.device = device
        #: the device's module (``torch.cuda``...); None on the CPU
        self.module = module
        self.use_streams = use_streams
        self.pool = pool
        self.stats = stats
        #: force_host_copy on the CPU: the "device" is the host itself, so copies out are
        #: plain host copies and restored tensors view the host bytes (no copy back)
        self.on_host = device is not None and device.type == "cpu"
        #: whether moved tensors stay alive while their copies are in flight (the automatic
        #: budget's window), and how many at most
        self.window = window
        self.stash = stash
        #: (device, direction) -> its side stream: one for copies out and one for prefetch
        #: back per device, so the two directions run at once (a stream runs in order)
        self.side_streams: dict[tuple[torch.device, bool], Any] = {}
        self.in_flight: deque[Flight] = deque()  #: device tensors whose copies may run
        #: the groups copies join, one per dtype and device (weakly: a graph dropped
        #: mid-forward frees its group, and the bytes it would send)
        self.open: dict[tuple[torch.dtype, torch.device], weakref.ref[_Group]] = {}
        self._bandwidth: tuple[float, float] | None = None

    def copy_out(
        self, t: torch.Tensor, copy: _HostCopy, ref: weakref.ref[_HostCopy], capacity: int
    ) -> None:
        """Move ``copy`` (``ref``: a weak reference to it) of ``t``'s storage to the host:
        it joins the open group (sent once full, or at ``__exit__``), or goes at once in a
        group of its own (``capacity``: what a group may hold)."""
        # Until sent, the group holds t as it is (a saved output's grad_fn then holds the
        # group back, through this copy's handle: a cycle that sending breaks, at the
        # latest at __exit__, which sends the open group).
        if copy.like is not None:
            # t is its whole storage: copied as it is, host side viewed to match (one op on
            # the device, where a byte view of the storage costs two more)
            src = t
        elif copy.dtype is t.dtype:  # the bytes, seen flat through t's dtype
            elem = t.element_size()
            src = t.as_strided((copy.nbytes // elem,), (1,), copy.byte_start // elem)
        else:
            src = _bytes_of(t.untyped_storage(), copy.device, copy.byte_start, copy.nbytes)
        stats = self.stats
        stats.to_host += 1
        stats.to_host_bytes += copy.nbytes
        # One open group per dtype and device: the float32 statistics a mixed-precision
        # layer saves between its bfloat16 activations do not close each other's groups.
        key = (copy.dtype, copy.device)
        opened = self.open.get(key)
        group = opened() if opened is not None else None
        if group is not None and group.fits(copy):
            group.add(copy, ref, src, t)
            return
        if copy.nbytes >= capacity:  # alone, at once; the open group stays open
            group = _Group(copy.nbytes, copy.dtype, copy.device)
            group.add(copy, ref, src, t)
            self.send(group)
            return
        if group is not None:
            self.send(group)  # full: off it goes
        group = _Group(capacity, copy.dtype, copy.device)
        group.add(copy, ref, src, t)
        self.open[key] = weakref.ref(group)

    def open_groups(self) -> list[_Group]:
        """The groups waiting to be sent, oldest first."""
        groups = []
        for ref in self.open.values():
            group = ref()
            if group is not None:
                groups.append(group)
        return groups

    def send_open(self) -> None:
        """Send every open group (a forward ends: a group holds one forward's copies)."""
        for group in self.open_groups():
            self.send(group)
        self.open.clear()

    def send(self, group: _Group) -> None:
        """Copy the group's bytes to a host block of their size, on the side stream where
        there is one (after the compute stream, which made them), with one event for all."""
        key = (group.dtype, group.device)
        opened = self.open.get(key)
        if opened is not None and opened() is group:
            del self.open[key]
        block, pairs = group.take_block(self.pool)
        group.sent = self.stats.groups  # copies out run in this order
        self.stats.groups += 1
        # Outside the pack hook (a full group, __exit__) autograd would record a copy
        # from t: grad mode off, as torch.no_grad() does, in two calls.
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            if self.on_host:
                for dst, src in pairs:
                    dst.copy_(src)
                return
            device = group.device
            module = self.module
            side = None
            if self.use_streams:
                side = self.side_streams.get((device, False)) or self.side(device, False)
            if side is not None:
                side.wait_stream(module.current_stream(device))  # the activations are made
            with module.stream(side):  # stream(None): stay on the current one
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=block.pinned)
                # the pool hands the block out again only once these copies have completed
                block.event = group.written = module.current_stream(device).record_event()
        finally:
            torch._C._set_grad_enabled(grad)
        if side is None or not block.pinned:
            return  # on the current stream, or synchronous: nothing to keep
        if self.window:
            # The device tensors stay alive until their copies retire.
            window = self.in_flight
            event = group.written
            for _, src in pairs:
                window.append((src, event))
            excess = len(window) - self.stash
            if excess > 0:  # the oldest retire
                self._let_go([window.popleft() for _ in range(excess)])
        else:
            # Let go of at once (a device budget, which counts them no more): the allocator
            # must not hand this memory to anyone before the copies ran.
            for _, src in pairs:
                src.record_stream(side)

    def copy_in(self, group: _Group, *, prefetch: bool = False) -> tuple[torch.Tensor, Any]:
        """Bring ``group``'s bytes back: needed now, on the current stream (after the copies
        out); ahead of use, on the side stream, into memory of the current stream (the
        side waits for the current stream first, as that memory may be its own; the
        consumer then waits for the copy's event: nothing to record on either stream).
        """
        host = group.on_host()  # raises unless the group was sent: it has its block
        block = cast(HostBlock, group.block)
        if self.on_host:
            # the host bytes are already where the tensor lives, so restored tensors view
            # them (no copy back); the block then stays theirs and is never handed out again
            group.lent = True
            return host, None
        stats = self.stats
        stats.to_device += 1
        stats.to_device_bytes += group.used
        module = self.module
        current = module.current_stream(group.device)
        if prefetch and self.use_streams:
            side = self.side_streams.get((group.device, True)) or self.side(group.device, True)
            if group.written is not None:  # the copy out, on the other side stream
                side.wait_event(group.written)
            with module.stream(side):  # the side stream's memory: waits for nothing else
                dev = torch.empty(host.shape, dtype=host.dtype, device=group.device)
                dev.copy_(host, non_blocking=block.pinned)
                event = side.record_event()
        else:
            if group.written is not None:
                current.wait_event(group.written)
            dev = group.to_device(non_blocking=block.pinned)
            event = current.record_event()
        block.event = event  # the host block is read until this completes
        return dev, event

    def let_go(self) -> None:
        """End the in-flight window's hold of every device tensor (``__exit__``): the
        compute stream never waits for the copies out here, so backward may begin while
        they run (only the copies back of their groups wait for them)."""
        self._let_go(list(self.in_flight))
        self.in_flight.clear()

    def _let_go(self, flights: list[Flight]) -> None:
        """End the in-flight window's hold of device tensors whose copies out recorded
        their events, before the compute stream waits for them. A tensor whose copy is
        done (its event says so: the common case) is let go as it is; else
        ``record_stream`` makes the allocator wait for the side stream first."""
        seen, running = None, False  # the last event asked (a group's copies share one)
        for t, event in flights:
            if event is not seen:
                seen, running = event, not event.query()
            if running:
                t.record_stream(self.side(t.device, False))

    def use_here(self, dev: torch.Tensor, event: Any) -> None:
        """Make ``dev``, written on another stream up to ``event``, usable on the current
        stream: wait for the write, and keep the allocator from reusing the memory before
        this stream is done with it."""
        current = self.module.current_stream(dev.device)
        current.wait_event(event)
        dev.record_stream(current)

    def allocated(self) -> int:
        """What the device's allocator counts allocated now."""
        return int(self.module.memory_allocated(self.device))

    def bandwidth(self, nbytes: int) -> tuple[float, float]:
        """The copy bandwidths each way (measured once, with ``nbytes``), on the side
        streams where there are."""
        if self._bandwidth is None:
            module = self.module
            device = cast(torch.device, self.device)
            if module is not None and self.use_streams:
                streams = (self.side(device, False), self.side(device, True))
            elif module is not None:
                current = module.current_stream(device)
                streams = (current, current)
            else:
                streams = (None, None)
            self._bandwidth = bandwidth(device, module, streams, nbytes)
        return self._bandwidth

    def side(self, device: torch.device, back: bool) -> Any:
        """The side stream of ``device`` for copies out (``back`` False) or prefetch back
        (True): made on first use, and kept under the device as given and with its index,
        so a tensor's own ``device`` finds it in one look-up."""
        indexed = torch.device(device.type, device_index(device))
        side = self.side_streams.get((indexed, back))
        if side is None:
            side = self.side_streams[(indexed, back)] = self.module.Stream(device=indexed)
        self.side_streams[(device, back)] = side
        return side


def _bytes_of(
    storage: torch.UntypedStorage, device: torch.device, start: int = 0, nbytes: int | None = None
) -> torch.Tensor:
    """A ``uint8`` view of ``storage``'s bytes ``[start, start + nbytes)`` (all by default)."""
    n = storage.nbytes() - start if nbytes is None else nbytes
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (n,), (1,))
