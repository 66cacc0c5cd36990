"""Receive buffers reused only once backward is done with them.

A :class:`RecvBufferPool` hands out buffers per (shape, dtype, device), each already
wrapped as a non-leaf activation (:func:`~leakfree.pipeline.as_nonleaf`), and takes a
buffer back when its slot has delivered or its graph was dropped. So a stage holds as many
buffers as it has microbatches in flight (the pipeline depth), not one per microbatch.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from leakfree.pipeline.slots import GradSlot, as_nonleaf

__all__ = ["PoolCounters", "RecvBuffer", "RecvBufferPool"]


@dataclass
class RecvBuffer:
    """A pool buffer, its slot, and the non-leaf activation made from them.

    ``activation`` is the only reference the caller needs to run forward: hand it over
    (``x, entry.activation = entry.activation, None``) so that the graph, not the entry,
    keeps it. ``tensor`` is the pool's buffer: it goes back to the pool when ``slot``
    delivers (or the graph is dropped) even while the entry is alive, and may then hold
    the next microbatch, so read and write it only before that.
    """

    tensor: torch.Tensor
    slot: GradSlot
    activation: torch.Tensor | None = None
    key: tuple[Any, ...] = field(default=(), repr=False)


@dataclass
class PoolCounters:
    """What a :class:`RecvBufferPool` has done so far (plain numbers, updated in place)."""

    allocated: int = 0  #: buffers created
    allocated_bytes: int = 0  #: bytes of all buffers created (in use or free)
    reused: int = 0  #: acquires served from the free list
    in_use: int = 0  #: buffers whose slot has not delivered yet


class RecvBufferPool:
    """Receive buffers per (shape, dtype, device), reused only once backward is done.

    ``acquire(shape, dtype, device)`` returns a :class:`RecvBuffer` whose ``activation``
    is ``as_nonleaf(buffer, slot)``. The buffer goes back to the free list when its slot
    has delivered (the stage's backward through it has finished), or when the activation's
    graph is dropped without backward. So the number of buffers is the number of
    microbatches in flight (the pipeline depth), not the number of microbatches.

    Kept: free buffers, by the pool, until the pool is dropped (there is no trim). A buffer
    in use is kept by its activation and whatever saved it for backward; the pool is not
    among its holders. Each buffer in use keeps the pool alive in turn (through a callback
    on its slot and a finalizer on its graph node) until it returns, once, at the first
    of: delivery, graph death.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.counters = PoolCounters()

    def acquire(
        self,
        shape: Sequence[int] | torch.Size,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        callback: Callable[[torch.Tensor], None] | None = None,
    ) -> RecvBuffer:
        key = (tuple(int(s) for s in shape), dtype, torch.device(device))
        if torch.is_inference_mode_enabled():
            raise RuntimeError(
                "RecvBufferPool.acquire under torch.inference_mode(): receive into a plain "
                "buffer; a pooled buffer is returned when its gradient is delivered"
            )
        with self._lock:
            free = self._free.get(key)
            buf = free.pop() if free else None
        new = buf is None
        if buf is None:
            buf = torch.empty(key[0], dtype=dtype, device=key[2])
        slot = GradSlot(callback)
        give_back = _GiveBack(self, buf, key)
        slot.on_delivered.append(give_back)
        try:
            activation = as_nonleaf(buf, slot)
        except BaseException:
            if not new:
                with self._lock:
                    self._free.setdefault(key, []).append(buf)
            raise
        with self._lock:
            self.counters.in_use += 1
            if new:
                self.counters.allocated += 1
                self.counters.allocated_bytes += buf.untyped_storage().nbytes()
            else:
                self.counters.reused += 1
        # If the graph dies without backward, the buffer comes back too.
        weakref.finalize(activation.grad_fn, give_back, None)
        return RecvBuffer(buf, slot, activation, key=key)

    def _release(self, buf: torch.Tensor, key: tuple[Any, ...]) -> None:
        with self._lock:
            self._free.setdefault(key, []).append(buf)
            self.counters.in_use -= 1


class _GiveBack:
    """Returns one buffer to its pool exactly once (first of: delivery, graph death)."""

    __slots__ = ("buf", "key", "pool")

    def __init__(self, pool: RecvBufferPool, buf: torch.Tensor, key: tuple[Any, ...]) -> None:
        self.pool: RecvBufferPool | None = pool
        self.buf: torch.Tensor | None = buf
        self.key = key

    def __call__(self, slot: GradSlot | None) -> None:
        pool, buf = self.pool, self.buf
        if pool is None or buf is None:
            return
        self.pool = self.buf = None
        pool._release(buf, self.key)
