"""The bytes of host memory offloading may pin: :class:`HostBudget`, this process's share
of the node (:func:`default_budget`, :data:`PROCESS_BUDGET`), and the one call that gives
pinned memory back to the system (:func:`release_host_cache`).

Pinned memory comes from PyTorch's caching host allocator, which keeps what is freed for
reuse (blocks of the same power-of-two size) until its cache is emptied, at no other time.
So a budget counts a pinned block's bytes from the block's making until they really leave
the process: while the block lives (``live``), and after it is freed while the allocator
still caches it (``parked``).
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from typing import cast

import torch

import leakfree._args as _args
from leakfree._device import accelerator
from leakfree.errors import OffloadWarning

__all__ = [
    "PROCESS_BUDGET",
    "HostBudget",
    "default_budget",
    "local_world_size",
    "release_host_cache",
]

#: the part of a node's physical memory its processes' default budgets share
NODE_FRACTION = 4  # a quarter

#: every budget alive, to learn of a release of the host cache (it is process-wide)
_BUDGETS: weakref.WeakSet[HostBudget] = weakref.WeakSet()
_warned_unknown = False


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover  (non-POSIX)
        return 16 << 30


def local_world_size() -> int:
    """How many processes of this job share the node: ``LOCAL_WORLD_SIZE`` (torchrun,
    torch.distributed.launch and Accelerate set it), else 1.

    A value that is not a whole number >= 1 counts as 1, with an :class:`OffloadWarning`
    that names it (a launcher's variable is never a reason to fail a training). With
    ``torch.distributed`` initialised on several ranks and no ``LOCAL_WORLD_SIZE``, the
    ranks on this node cannot be counted without a collective, so 1 is assumed, and said
    once."""
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None:
        _warn_unknown()
        return 1
    try:
        n = int(raw.strip())
    except ValueError:
        n = 0
    if n < 1:
        warnings.warn(
            f"leakfree: LOCAL_WORLD_SIZE={raw!r}: expected the number of this job's "
            "processes on this node (a whole number >= 1); the pinned host memory budget "
            "is sized for 1. Fix the variable, or pass pin_memory_budget= (bytes for "
            "this process) to OffloadActivations.",
            OffloadWarning,
            stacklevel=3,
        )
        return 1
    return n


def _warn_unknown() -> None:
    global _warned_unknown
    if _warned_unknown:
        return
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    _warned_unknown = True
    warnings.warn(
        f"leakfree: {dist.get_world_size()} ranks and no LOCAL_WORLD_SIZE: the pinned host "
        "memory budget assumes this rank is alone on its node, so ranks sharing a node "
        "may pin more than the node can spare. Set LOCAL_WORLD_SIZE to the ranks per node "
        "(torchrun does), or pass pin_memory_budget= (bytes for this process).",
        OffloadWarning,
        stacklevel=4,
    )


def default_budget() -> int:
    """This process's default budget, in bytes: a quarter of the node's physical memory,
    divided among the job's processes on the node (:func:`local_world_size`). Read anew
    at each call."""
    return _physical_memory() // NODE_FRACTION // local_world_size()


class HostBudget:
    """Bytes of pooled host blocks that may be held at once, by one or several pools.

    ``limit`` (bytes; None: :func:`default_budget`, decided at its first use, so a
    launcher's variables set before the first offloaded step count). A block reserves its
    size when it is made within the budget (:meth:`try_reserve`) and gives it back when it
    is freed (:meth:`give_back`: its finalizer queues the bytes, never a lock there, as
    it may run inside a garbage collection). A *pinned* block's bytes then stay counted,
    as ``parked``, until the host allocator's cache is emptied (:func:`release_host_cache`),
    except that a new pinned block of the same size takes them over (the allocator hands
    the cached bytes out again). Kept: those counts, until the budget dies.
    """

    def __init__(self, limit: int | None = None) -> None:
        _args.count("HostBudget", "limit", limit, 0, none=True, unit="bytes")
        self._limit = limit
        self._live = 0
        self._parked: dict[int, int] = {}  # size -> freed pinned blocks the cache keeps
        self._parked_bytes = 0
        self._freed: deque[tuple[int, bool]] = deque()
        self._lock = threading.Lock()
        _BUDGETS.add(self)

    @property
    def limit(self) -> int:
        """The most bytes counted at once (settable)."""
        if self._limit is None:
            self._limit = default_budget()
        return self._limit

    @limit.setter
    def limit(self, value: int) -> None:
        self._limit = _args.count("HostBudget.limit", None, value, 0, unit="bytes")

    @property
    def used(self) -> int:
        """Bytes counted now: ``live`` and ``parked``."""
        with self._lock:
            self._settle()
            return self._live + self._parked_bytes

    @property
    def live(self) -> int:
        """Bytes of the blocks alive (cached by a pool, or in use by a graph)."""
        with self._lock:
            self._settle()
            return self._live

    @property
    def parked(self) -> int:
        """Bytes of freed pinned blocks the host allocator may still cache."""
        with self._lock:
            self._settle()
            return self._parked_bytes

    def _settle(self) -> None:
        while self._freed:
            size, pinned = self._freed.popleft()
            self._live -= size
            if pinned:
                self._parked[size] = self._parked.get(size, 0) + 1
                self._parked_bytes += size

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more would stay within the limit."""
        return self.used + nbytes <= self.limit

    def try_reserve(self, nbytes: int, pinned: bool = False) -> bool:
        """Count a new block of ``nbytes`` if it fits (a pinned one first takes over the
        parked bytes of its size, which the allocator hands out again)."""
        limit = self.limit
        with self._lock:
            self._settle()
            if pinned and self._parked.get(nbytes):
                self._parked[nbytes] -= 1
                self._parked_bytes -= nbytes
            elif self._live + self._parked_bytes + nbytes > limit:
                return False
            self._live += nbytes
            return True

    def give_back(self, nbytes: int, pinned: bool = False) -> None:
        """A block of ``nbytes`` was freed (never blocks: safe from a finalizer)."""
        self._freed.append((nbytes, pinned))  # atomic

    def _unpark(self, released: dict[int, int]) -> None:
        """The host cache was emptied: what was parked before it is gone."""
        with self._lock:
            for size, n in released.items():
                self._parked[size] -= n
                self._parked_bytes -= n * size


def _host_cache_release() -> Callable[[], None] | None:
    """PyTorch's call that empties the accelerator's host cache, where there is one."""
    device = accelerator()
    if device is None:
        return None
    name = getattr(torch._C, "_get_privateuse1_backend_name", lambda: "privateuseone")()
    if device.type == name:  # out of tree: torch crashes where it has no host allocator
        return None
    empty = getattr(torch.accelerator, "empty_host_cache", None)
    if empty is None and device.type == "cuda":  # torch before torch.accelerator's
        empty = getattr(torch._C, "_host_emptyCache", None)
    return cast("Callable[[], None] | None", empty)


def release_host_cache() -> None:
    """Give the pinned memory PyTorch's host allocator caches back to the system, and with
    it every budget's ``parked`` bytes.

    The cache is the process's: blocks others freed go too (a data loader's pinned
    batches are pinned again on their next use). On CUDA, freeing pinned memory waits for
    the device. Without an accelerator nothing is pinned; on an out-of-tree one
    (PrivateUse1), whose host allocator torch cannot tell exists, nothing is called:
    either way only the counts change.
    """
    released = {}
    for budget in list(_BUDGETS):
        with budget._lock:
            budget._settle()
            released[budget] = {s: n for s, n in budget._parked.items() if n}
    empty = _host_cache_release()
    if empty is not None:
        empty()
    for budget, parked in released.items():
        budget._unpark(parked)


#: The budget every pool shares unless given its own: this process's share of the node
#: (:func:`default_budget`), decided when a pool first needs it.
PROCESS_BUDGET = HostBudget()
