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
from collections.abc import Callable
from typing import Any, cast

import torch

from leakfree._allocator import reader
from leakfree._device import device_index
from leakfree.offload.handles import Arrival, _Group, _HostCopy
from leakfree.offload.link import Link, probe
from leakfree.offload.pool import HostBlock, HostBlockPool
from leakfree.offload.stats import OffloadStats
from leakfree.offload.streams import Flight


class Transfers:
    """The copies and their streams (see the module doc).

    Kept here: the pool's free host blocks (until the pool is trimmed or dies), the side
    streams, weak references to the open groups, and the window: the device tensors of the
    latest copies out until they retire (as many as ``window()`` says; none after
    ``__exit__``). Nothing else per step: the graph owns the groups and their
    blocks."""

    def __init__(
        self,
        device: torch.device | None,
        module: Any,
        *,
        use_streams: bool,
        pool: HostBlockPool,
        stats: OffloadStats,
        window: Callable[[], tuple[int | None, int | None]],
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
        #: the window: device tensors kept alive while their copies out run (so the copies
        #: read what was saved); ``window()`` says how many bytes and tensors it holds at
        #: most (None: any), as the plan decides
        self.window = window
        #: how the compute stream waits for a copy's event (a measured step times it)
        self.wait: Callable[[Any, Any], None] = _wait
        #: (device, direction) -> its side stream: one for copies out and one for prefetch
        #: back per device, so the two directions run at once (a stream runs in order)
        self.side_streams: dict[tuple[torch.device, bool], Any] = {}
        self.in_flight: deque[Flight] = deque()  #: device tensors whose copies may run
        self.in_flight_bytes = 0
        #: the groups copies join, one per dtype and device (weakly: a graph dropped
        #: mid-forward frees its group, and the bytes it would send)
        self.open: dict[tuple[torch.dtype, torch.device], weakref.ref[_Group]] = {}
        self._link: Link | None = None
        #: the device allocator's counts, read cheaply (None: the CPU, or no statistics)
        self.read = reader(device, module) if device is not None else None

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
                if block.event is not None:  # its last copy back may still read it
                    module.current_stream(device).wait_event(block.event)
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=block.pinned)
                # whoever writes the block next waits for these copies (above), and the
                # pool hands out blocks whose copies completed first
                block.event = group.written = module.current_stream(device).record_event()
        finally:
            torch._C._set_grad_enabled(grad)
        if side is None or not block.pinned:
            return  # on the current stream, or synchronous: nothing to keep
        # The device tensors stay alive in the window while their copies run, and retire
        # oldest first once it is full (see _retire).
        window = self.in_flight
        event = group.written
        for _, src in pairs:
            window.append((src, event, src.nbytes))
            self.in_flight_bytes += src.nbytes
        self._retire(*self.window())

    def copy_in(
        self, group: _Group, *, prefetch: bool = False
    ) -> tuple[torch.Tensor, Arrival | None]:
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
            # Memory of the current stream, which backward frees and reuses in its order (a
            # side stream's pool would hold every buffer it ever prefetched apart): the copy
            # waits for the current stream's earlier use of that memory, and for the copy out.
            dev = torch.empty(host.shape, dtype=host.dtype, device=group.device)
            side.wait_event(current.record_event())
            if group.written is not None:  # the copy out, on the other side stream
                side.wait_event(group.written)
            with module.stream(side):
                dev.copy_(host, non_blocking=block.pinned)
                event = side.record_event()
        else:
            if group.written is not None:
                current.wait_event(group.written)
            dev = group.to_device(non_blocking=block.pinned)
            event = current.record_event()
        block.event = event  # the host block is read until this completes
        return dev, Arrival(event, current)

    def _retire(self, keep_bytes: int | None, keep_count: int | None) -> None:
        """Let the window's oldest tensors go until it holds at most ``keep_bytes`` bytes
        (None: any) and ``keep_count`` tensors (None: any). One whose copy the host has
        seen complete goes as it is. One whose copy may still run goes *in stream order*:
        the compute stream waits for its copy's event, and the tensor is dropped without
        ``record_stream``, so the allocator hands its memory to the compute stream's next
        allocations at once, which run after the copy. (``record_stream`` would keep the
        memory from everyone until the host saw the copy end: with the host running ahead
        of the device, that is most of the forward, and offloading would lower what the
        device holds by nothing.) The compute stream then waits only where the copies out
        fall behind it by more than the window."""
        window = self.in_flight
        waited = None  # a group's copies share one event: one wait for all of them
        while window and (
            (keep_bytes is not None and self.in_flight_bytes > keep_bytes)
            or (keep_count is not None and len(window) > keep_count)
        ):
            t, event, nbytes = window.popleft()
            self.in_flight_bytes -= nbytes
            if event is not waited and not event.query():
                self.wait(self.module.current_stream(t.device), event)
                waited = event

    def let_go(self) -> None:
        """End the window's hold of every device tensor (``__exit__``), without a wait: a
        tensor whose copy the host has not seen complete is recorded on the side stream
        (``record_stream``: its memory is handed out again once the copy has ended), so
        backward may begin while the last copies out run. What is held that way is at most
        the window."""
        seen, running = None, False  # the last event asked (a group's copies share one)
        for t, event, _ in self.in_flight:
            if event is not seen:
                seen, running = event, not event.query()
            if running:
                t.record_stream(self.side(t.device, False))
        self.in_flight.clear()
        self.in_flight_bytes = 0

    def use_here(self, dev: torch.Tensor, arrival: Arrival) -> None:
        """Make ``dev``, which ``arrival`` brought back, usable on the current stream: it
        waits for the copy; and when the memory is another stream's (a pass on another
        stream), ``record_stream`` keeps that stream's allocator from reusing it before
        this one is done with it."""
        current = self.module.current_stream(dev.device)
        current.wait_event(arrival.event)
        if current != arrival.home:
            dev.record_stream(current)

    def link(self, nbytes: int) -> Link:
        """The link each way and both at once (measured once, with ``nbytes``:
        :func:`~leakfree.offload.link.probe`), on the side streams where there are."""
        if self._link is None:
            module = self.module
            device = cast(torch.device, self.device)
            if module is not None and self.use_streams:
                streams = (self.side(device, False), self.side(device, True))
            elif module is not None:
                current = module.current_stream(device)
                streams = (current, current)
            else:
                streams = (None, None)
            self._link = probe(device, module, streams, nbytes)
        return self._link

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


def _wait(stream: Any, event: Any) -> None:
    stream.wait_event(event)


def _bytes_of(
    storage: torch.UntypedStorage, device: torch.device, start: int = 0, nbytes: int | None = None
) -> torch.Tensor:
    """A ``uint8`` view of ``storage``'s bytes ``[start, start + nbytes)`` (all by default)."""
    n = storage.nbytes() - start if nbytes is None else nbytes
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (n,), (1,))
