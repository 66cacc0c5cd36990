"""Copies between the device and the host: out in forward (a group at a time, on the out
side stream), back in backward (now, on the current stream, or ahead, on the prefetch
side stream), and what keeps their memory safe (the in-flight window, ``record_stream``,
the events the consumers wait on).

:class:`_Transfers` is the part of :class:`~leakfree.offload.OffloadActivations` that
makes the copies; it reads the manager's state (:class:`~leakfree.offload.state.ManagerState`).
"""

from __future__ import annotations

import weakref
from typing import Any, cast

import torch

from leakfree._device import device_index
from leakfree.offload.handles import _Group, _HostCopy
from leakfree.offload.pool import HostBlock
from leakfree.offload.state import ManagerState
from leakfree.offload.streams import Flight


class _Transfers(ManagerState):
    """The copies and their streams (see the module doc)."""

    def _copy_out(self, t: torch.Tensor, copy: _HostCopy, ref: weakref.ref[_HostCopy]) -> None:
        """Move ``copy`` (``ref``: a weak reference to it) of ``t``'s storage to the host:
        it joins the open group (sent once full, or at ``__exit__``), or goes at once in a
        group of its own."""
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
        opened = self._open.get(key)
        group = opened() if opened is not None else None
        if group is not None and group.fits(copy):
            group.add(copy, ref, src, t)
            return
        capacity = self._planner.capacity
        if copy.nbytes >= capacity:  # alone, at once; the open group stays open
            group = _Group(copy.nbytes, copy.dtype, copy.device)
            group.add(copy, ref, src, t)
            self._send(group)
            return
        if group is not None:
            self._send(group)  # full: off it goes
        group = _Group(capacity, copy.dtype, copy.device)
        group.add(copy, ref, src, t)
        self._open[key] = weakref.ref(group)

    def _send(self, group: _Group) -> None:
        """Copy the group's bytes to a host block of their size, on the side stream where
        there is one (after the compute stream, which made them), with one event for all."""
        key = (group.dtype, group.device)
        opened = self._open.get(key)
        if opened is not None and opened() is group:
            del self._open[key]
        block, pairs = group.take_block(self.pool)
        group.sent = self.stats.groups  # copies out run in this order
        self.stats.groups += 1
        # Outside the pack hook (a full group, __exit__) autograd would record a copy
        # from t: grad mode off, as torch.no_grad() does, in two calls.
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            if self._on_host:
                for dst, src in pairs:
                    dst.copy_(src)
                return
            device = group.device
            module = self._device_module
            side = None
            if self.use_streams:
                side = self._side_streams.get((device, False)) or self._side(device, False)
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
        if self._window:
            # The device tensors stay alive until their copies retire.
            window = self._in_flight
            event = group.written
            for _, src in pairs:
                window.append((src, event))
            excess = len(window) - self.max_fwd_stash_size
            if excess > 0:  # the oldest retire
                self._let_go([window.popleft() for _ in range(excess)])
        else:
            # Let go of at once (a device budget, which counts them no more): the allocator
            # must not hand this memory to anyone before the copies ran.
            for _, src in pairs:
                src.record_stream(side)

    def _copy_in(self, group: _Group, *, prefetch: bool = False) -> tuple[torch.Tensor, Any]:
        """Bring ``group``'s bytes back: needed now, on the current stream (after the copies
        out); ahead of use, on the side stream, into memory of the current stream (the
        side waits for the current stream first, as that memory may be its own; the
        consumer then waits for the copy's event: nothing to record on either stream).
        """
        host = group.on_host()  # raises unless the group was sent: it has its block
        block = cast(HostBlock, group.block)
        if self._on_host:
            # the host bytes are already where the tensor lives, so restored tensors view
            # them (no copy back); the block then stays theirs and is never handed out again
            group.lent = True
            return host, None
        stats = self.stats
        stats.to_device += 1
        stats.to_device_bytes += group.used
        module = self._device_module
        current = module.current_stream(group.device)
        if prefetch and self.use_streams:
            side = self._side_streams.get((group.device, True)) or self._side(group.device, True)
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
                t.record_stream(self._side(t.device, False))

    def _use_here(self, dev: torch.Tensor, event: Any) -> None:
        """Make ``dev``, written on another stream up to ``event``, usable on the current
        stream: wait for the write, and keep the allocator from reusing the memory before
        this stream is done with it."""
        current = self._device_module.current_stream(dev.device)
        current.wait_event(event)
        dev.record_stream(current)

    def _side(self, device: torch.device, back: bool) -> Any:
        """The side stream of ``device`` for copies out (``back`` False) or prefetch back
        (True): made on first use, and kept under the device as given and with its index,
        so a tensor's own ``device`` finds it in one look-up."""
        indexed = torch.device(device.type, device_index(device))
        side = self._side_streams.get((indexed, back))
        if side is None:
            side = self._side_streams[(indexed, back)] = self._device_module.Stream(device=indexed)
        self._side_streams[(device, back)] = side
        return side


def _bytes_of(
    storage: torch.UntypedStorage, device: torch.device, start: int = 0, nbytes: int | None = None
) -> torch.Tensor:
    """A ``uint8`` view of ``storage``'s bytes ``[start, start + nbytes)`` (all by default)."""
    n = storage.nbytes() - start if nbytes is None else nbytes
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (n,), (1,))
