"""The stream policy: which device tensors stay while their copy is in flight, and which
host copies backward brings back ahead of time.

Everything here is plain Python over weak references, tested on CPU: it owns no payload,
so dropping a graph is never delayed by it.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterator

from leakfree.offload.handles import _HostCopy, _Offloaded, _Session


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
