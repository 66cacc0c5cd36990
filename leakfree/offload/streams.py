"""The stream policy of one ``with`` block: its tape (pack order), dedup map, in-flight
window and backward prefetch.

Everything here is plain Python over weak references, tested on CPU: a :class:`_Session`
owns no payload, so dropping a graph is never delayed by it.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from leakfree.offload.hooks import _HostCopy, _Offloaded


class _Session:
    """One ``with`` block's pack order (for prefetch) and storage dedup map.

    Holds handles and host copies weakly: it owns no payload. The tape drops its dead
    prefix as it grows, so one ``with`` around a whole training loop stays cheap.
    """

    __slots__ = ("__weakref__", "base", "prefetching", "shared", "tape")

    def __init__(self) -> None:
        self.tape: deque[weakref.ref[_Offloaded]] = deque()
        self.base = 0  # pack index of tape[0]
        #: (storage address, version) -> the host copy made of it (weakly); one forward's
        #: worth of entries, dropped with the session
        self.shared: dict[tuple[int, int], weakref.ref[_HostCopy]] = {}
        #: copies with a prefetched device copy not yet consumed, weakly, in plan order
        self.prefetching: deque[weakref.ref[_HostCopy]] = deque()

    def next_index(self) -> int:
        return self.base + len(self.tape)

    def append(self, handle: _Offloaded) -> None:
        self.tape.append(weakref.ref(handle))
        if len(self.tape) >= 2048 and self.tape[0]() is None:
            while self.tape and self.tape[0]() is None:  # a dead prefix: earlier steps
                self.tape.popleft()
                self.base += 1

    def handle_at(self, index: int) -> _Offloaded | None:
        i = index - self.base
        return self.tape[i]() if 0 <= i < len(self.tape) else None

    def shared_copy(self, storage: torch.UntypedStorage, version: int) -> _HostCopy | None:
        """A host copy of this very storage, at this version, made during this forward.

        Keyed by address and version counter (an in-place write makes a new copy), and
        valid only while the storage it was copied from is alive (an address is reused
        only after its storage died): no stale keys, nothing to clean up. Writes that
        bypass the version counter (through ``.data``, ``set_`` or numpy aliases) between
        two saves are not seen: PyTorch does not track them either.
        """
        ref = self.shared.get((storage.data_ptr(), version))
        copy = ref() if ref is not None else None
        if copy is not None and copy.source is not None and copy.source() is not None:
            return copy
        return None

    def remember(self, copy: _HostCopy, storage: torch.UntypedStorage, version: int) -> None:
        """Let later saves of ``storage`` at ``version`` in this forward share ``copy``."""
        copy.source = weakref.ref(storage)
        self.shared[(storage.data_ptr(), version)] = weakref.ref(copy)


def _retire(
    window: deque[weakref.ref[_Offloaded]], new: weakref.ref[_Offloaded], limit: int
) -> Iterator[_Offloaded]:
    """Add ``new`` to the in-flight window; yield the handles that must leave it.

    Dead entries (their graph was dropped) leave silently; the oldest live ones leave until
    at most ``limit`` remain.
    """
    window.append(new)
    while len(window) > limit:
        old = window.popleft()()
        if old is not None and old.in_flight is not None:
            yield old


def _prune_prefetching(window: deque[weakref.ref[_HostCopy]], current: int) -> int:
    """Drop prefetches that were consumed, died, or that backward has moved past.

    Backward runs towards lower pack indexes: a prefetched copy whose handles are all at or
    above ``current`` and was not consumed is not going to be (an unused branch, a partial
    ``autograd.grad``); its device copy is dropped. Returns how many are still pending.
    """
    kept: deque[weakref.ref[_HostCopy]] = deque()
    while window:
        ref = window.popleft()
        copy = ref()
        if copy is None or copy.prefetched is None:
            continue
        if copy.index >= current:
            copy.prefetched = None  # stale: free its device memory now
            continue
        kept.append(ref)
    window.extend(kept)
    return len(window)


#: How far back (in pack order) one prefetch plan looks past dead entries.
_PLAN_SCAN = 256


def _prefetch_plan(session: _Session, current: _Offloaded, budget: int) -> list[_HostCopy]:
    """Host copies to bring back ahead of time: those packed just before ``current``.

    Backward runs roughly in reverse pack order, so the tensors saved right before the one
    being unpacked are needed next. Skips what is still on device, already restored or
    prefetched, and handles whose graph is gone; looks at most ``_PLAN_SCAN`` entries back.
    At most ``budget`` copies.
    """
    plan: list[_HostCopy] = []
    if budget <= 0:
        return plan
    seen: set[int] = {id(current.copy)}
    stop = max(session.base, current.index - _PLAN_SCAN)
    for index in range(current.index - 1, stop - 1, -1):
        handle = session.handle_at(index)
        if handle is None or handle.in_flight is not None or id(handle.copy) in seen:
            continue
        copy = handle.copy
        seen.add(id(copy))
        if copy.prefetched is not None or copy.live_restored() is not None:
            continue
        plan.append(copy)
        if len(plan) >= budget:
            break
    return plan
