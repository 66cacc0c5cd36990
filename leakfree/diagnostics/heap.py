"""The CPU's cheap signal: bytes the C heap has handed out and not taken back.

On an accelerator the allocator counts live bytes for free (``memory_allocated``). The CPU
has no such counter in torch, and the exact alternative, a dispatch mode that follows
every storage (:class:`~leakfree.diagnostics.memory.StorageTracker`), makes a small
model's step 2-3x slower. The C library keeps the count anyway: a CPU tensor's storage,
an autograd node, a ``TensorImpl`` are all ``malloc``-ed, so glibc's ``mallinfo2()``
(in-use bytes of its arenas plus its ``mmap``-ed chunks) moves with every one of them. One
call costs 5-15 microseconds, so it is read at every step and after every backward.

It is a signal, not a verdict: it also counts Python objects above 512 B, library caches
and other threads' allocations. A tracker uses it to *suspect* growth, then follows the
storages exactly for a few steps to confirm it and to learn where they were made
(:mod:`~leakfree.diagnostics.detector`).

Where glibc is not the allocator (macOS, Windows, musl, a preloaded tcmalloc that does
not answer ``mallinfo2``) :func:`heap_counter` returns None and the tracker follows
storages exactly until a run has been judged clean. Whether the counter sees the tensors
is checked once, by allocating one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

__all__ = ["heap_counter"]

_FIELDS = (
    "arena",
    "ordblks",
    "smblks",
    "hblks",
    "hblkhd",
    "usmblks",
    "fsmblks",
    "uordblks",
    "fordblks",
    "keepcost",
)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


#: a probe allocation the counter must see (well above the mmap threshold's default)
_PROBE = 1 << 20


@functools.cache
def heap_counter() -> Callable[[], int] | None:
    """A function returning the bytes in use on the C heap now, or None where there is no
    such count that sees CPU tensors (checked once per process)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):  # not glibc, or glibc < 2.33
        return None
    mallinfo2.restype = _Mallinfo2
    mallinfo2.argtypes = []

    def in_use() -> int:
        info = mallinfo2()
        return int(info.uordblks + info.hblkhd)

    import torch

    # A preloaded allocator answers with its own numbers or none: trust only a count that
    # sees the probe's bytes (three tries: another thread may allocate or free meanwhile).
    for _ in range(3):
        before = in_use()
        probe = torch.empty(_PROBE, dtype=torch.uint8)
        seen = in_use() - before
        del probe
        if _PROBE <= seen < 2 * _PROBE:
            return in_use
    return None
