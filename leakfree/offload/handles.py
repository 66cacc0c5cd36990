"""What the graph owns: the handles the pack hook returns, the host copies they share, and
their ``with`` block's pack order.

The pack hook returns a handle (:class:`_Offloaded`, or :class:`_Kept` for what stays on
the device); the graph owns it, and it owns everything else: its :class:`_HostCopy` (a pool
block holding the bytes, returned when the last handle using it dies) and its
:class:`_Session` (the pack order and dedup map, held weakly). Nothing here refers to the
context manager strongly; see :mod:`leakfree.offload` for the lifetime contract.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from leakfree.offload.pool import HostBlockPool


class _Restorer(Protocol):
    """What a handle asks of the manager that packed it (``OffloadActivations``), which it
    holds weakly: bring its bytes back (and look ahead)."""

    def _restore(self, handle: _Offloaded) -> torch.Tensor: ...

    def _note(self, copy: _HostCopy) -> None: ...


def _span(t: torch.Tensor) -> tuple[int, int]:
    """First and one-past-last element index of ``t`` in its storage (in elements)."""
    offset = int(t.storage_offset())
    if t.is_contiguous():  # the common case, without a walk over the strides
        return offset, offset + t.numel()
    if t.numel() == 0:
        return offset, offset
    last = offset + sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride()))
    return offset, last + 1


def _version_error(t_version: int, saved_version: int, shape: Any) -> RuntimeError:
    # The check PyTorch makes for saved tensors, which it skips whenever saved-tensor
    # hooks are installed: made here so hooks do not hide in-place bugs.
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: a saved tensor of shape {list(shape)} is at version "
        f"{t_version}; expected version {saved_version} instead (checked by leakfree, "
        "because PyTorch does not check tensors that pass through saved-tensor hooks)"
    )


class _Kept:
    """A saved tensor that stays where it is, with its version at save time.

    Detached when it has a ``grad_fn``: a saved *output* reaches the pack hook with
    ``grad_fn`` set to the very node that saves it, and storing it as is closes a cycle
    through C++ (node -> saved tensor -> grad_fn -> node) that no garbage collector can
    free, so a graph dropped without backward would leak with everything upstream of it.
    Autograd restores the autograd metadata on unpack itself. A tensor without one (a
    parameter, a leaf, anything made without grad) can close no cycle: it is kept as it
    is, which spares an operation on the device per saved weight.
    """

    __slots__ = ("__weakref__", "tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        # detach: shares storage and version counter, holds no grad_fn
        self.tensor = t if t.grad_fn is None else t.detach()
        self.version = t._version

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        if t._version != self.version:
            raise _version_error(t._version, self.version, t.shape)
        return t


class _Session:
    """One forward's storage dedup map (a ``with`` block, entered at depth 0): later saves
    of a storage at the same version share the copy made of it.

    Keyed by address and version counter (an in-place write makes a new copy), and valid
    only while the storage it was copied from is alive (``copy.source``; an address is
    reused only after its storage died): no stale keys, nothing to clean up. Writes that
    bypass the version counter (through ``.data``, ``set_`` or numpy aliases) between two
    saves are not seen: PyTorch does not track them either. Holds the copies weakly: it
    owns no payload.
    """

    __slots__ = ("__weakref__", "shared")

    def __init__(self) -> None:
        #: (storage address, version) -> the copy made of it (weakly); one forward's worth
        #: of entries, dropped with the session
        self.shared: dict[tuple[int, int], weakref.ref[_HostCopy]] = {}


class _HostCopy:
    """The bytes of (a span of) one device storage, shared by the handles that use them.

    Two states. *Held on the device* (a device budget keeps it there): ``pending`` is the
    detached device tensor and nothing is copied. *On the host*: ``block`` is a pool block
    holding the bytes, returned to the pool when the last handle using it dies. Moving from
    the first state to the second is the copy out; there is no way back.

    During a backward pass the storage restored from it is kept (``keep``) until the last
    handle using it has been unpacked in that pass, so views of one storage needed by
    several backward nodes are copied back once per pass; the pass's end drops whatever is
    left (handles a partial pass never reached).
    """

    __slots__ = (
        "__weakref__",
        "block",
        "byte_start",
        "device",
        "dtype",
        "keep",
        "lent",
        "like",
        "nbytes",
        "pending",
        "pool",
        "prefetched",
        "remaining",
        "restored",
        "seq",
        "source",
        "task",
        "typed",
        "users",
        "version",
        "written",
    )

    def __init__(self, nbytes: int, byte_start: int, device: torch.device) -> None:
        self.block: Any = None
        self.typed: torch.Tensor | None = None  # the block's bytes, as copied (see attach)
        self.pool: Any = None  # weak reference to the pool the block returns to
        self.nbytes = nbytes
        self.byte_start = byte_start  # where the copied bytes start in the source storage
        self.device = device
        self.dtype = torch.uint8  # what it is copied back as: its first tensor's, if whole
        self.seq = 0  # creation order, across every forward of the manager (set when kept)
        self.users = 0  # handles made for it
        #: (dtype, shape) when its first handle's tensor is exactly these bytes (contiguous,
        #: from the start): it is then copied back as that tensor, which every handle of
        #: that very geometry returns as it is (no view: one device op fewer each)
        self.like: tuple[torch.dtype, torch.Size] | None = None
        self.version = 0  # the source's version counter when saved
        self.lent = False  # restored tensors view the block itself (CPU): never reuse it
        self.source: Any = None  # weak reference to the source storage (dedup validity)
        self.pending: torch.Tensor | None = None  # held on the device: the saved tensor
        #: (weak reference to the restored storage, the event its copy-in recorded): the
        #: storage, since what autograd keeps of an unpacked tensor may be another tensor
        #: object over it (a double-backward graph)
        self.restored: tuple[Any, Any] | None = None
        self.prefetched: tuple[torch.Tensor, Any] | None = None  # (device bytes, event)
        self.written: Any = None  # the event the copy out recorded (None: synchronous)
        #: the backward pass (graph task id) that last unpacked it, the storage kept for
        #: that pass's other handles, with its event, and how many are still to unpack
        self.task = -1
        self.keep: tuple[torch.Tensor, Any] | None = None
        self.remaining = 0

    def attach(self, pool: HostBlockPool) -> torch.Tensor:
        """Take a host block for the bytes; returns them as they are copied (``typed``):
        the one handle's own tensor (``like``), or a flat tensor of ``dtype``."""
        # Weak: a graph keeps its own host bytes, not the pool and its free blocks.
        self.pool = weakref.ref(pool)
        block = self.block = pool.acquire(self.nbytes)
        like = self.like
        if like is not None:
            typed = block.view(self.nbytes, like[0], like[1])
        else:
            typed = block.view(self.nbytes, self.dtype)
        self.typed = typed
        return typed

    def on_host(self) -> torch.Tensor:
        """The host bytes as they are copied back (``typed``); only for a copy that was
        moved (a copy held on the device has none)."""
        typed = self.typed
        if typed is None:
            raise RuntimeError(
                "leakfree: a host copy was read back before it was moved to the host "
                "(held on the device by a device budget); please report this"
            )
        return typed

    def to_device(self, non_blocking: bool = False) -> torch.Tensor:
        """A new device tensor holding these bytes, copied on the current stream."""
        host = self.on_host()
        dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        return dev.copy_(host, non_blocking=non_blocking)

    def live_restored(self) -> tuple[torch.Tensor, Any] | None:
        """The bytes a sibling handle restored, if their storage is still alive (as they
        were copied back: ``typed``'s dtype and shape), and the event of that copy-in."""
        if self.restored is None:
            return None
        storage = self.restored[0]()
        if storage is None:
            return None
        typed = self.on_host()  # restored: so it was moved
        dev = torch.empty(0, dtype=typed.dtype, device=self.device)
        return dev.set_(storage, 0, typed.shape, typed.stride()), self.restored[1]

    def __del__(self) -> None:
        block = getattr(self, "block", None)
        pool = self.pool() if block is not None else None
        if block is not None and pool is not None:
            # never blocks: safe inside a garbage collection
            pool.release(block, reuse=not self.lent)
        # (pool gone: the block's memory is freed with it)


class _Offloaded:
    """The packed form of one saved tensor: the graph owns it, and it owns everything."""

    __slots__ = (
        "__weakref__",
        "copy",
        "dtype",
        "element_offset",
        "in_flight",
        "manager",
        "same",
        "shape",
        "stride",
        "task",
        "version",
    )

    def __init__(
        self,
        manager: Callable[[], _Restorer | None],  # a weak reference
        copy: _HostCopy,
        t: torch.Tensor,
        element_offset: int,
    ) -> None:
        # Weak, like the hooks: a graph keeps its payloads, never the context manager.
        self.manager = manager
        self.copy = copy
        copy.users += 1
        self.dtype = t.dtype
        self.shape = t.shape
        self.stride = t.stride()
        like = copy.like
        #: the restored tensor is this handle's as it is (``like``): no view to make
        self.same = (
            like is not None
            and like[0] is t.dtype
            and like[1] == t.shape
            and element_offset == 0
            and t.is_contiguous()
        )
        self.version = t._version
        self.element_offset = element_offset  # storage offset within the copied bytes
        #: the device tensor while its device-to-host copy is in flight: held as it is (a
        #: saved output's grad_fn then holds this handle back, a cycle the window's end
        #: breaks, at the latest at ``__exit__``), detached only if unpacked meanwhile
        self.in_flight: torch.Tensor | None = None
        self.task = -1  # the backward pass that last unpacked it

    def unpack(self) -> torch.Tensor:
        t = self.in_flight
        if t is not None:  # never left the device: its copy has not even retired
            if t._version != self.version:
                raise _version_error(t._version, self.version, t.shape)
            return t.detach()
        copy = self.copy
        held = copy.pending
        if held is not None:  # a device budget kept it: a view of the saved tensor
            if held._version != self.version:
                raise _version_error(held._version, self.version, self.shape)
            manager = self.manager()
            if manager is not None:
                manager._note(copy)  # its place in the pass's order, for later prefetch
            return self.view_of(held, copy.byte_start)  # the saved tensor, or a view of it
        manager = self.manager()
        if manager is not None:
            return manager._restore(self)
        # dropped while its graph lives on: a plain synchronous copy back
        return self.view_of(_restore_without_manager(copy))

    def view_of(self, base: torch.Tensor, start: int = 0) -> torch.Tensor:
        """This handle's tensor over ``base``, a device tensor whose storage holds the
        copy's bytes from byte ``start`` on (0: restored; ``byte_start``: held on the
        device): ``base`` itself when it is exactly the handle's tensor (``same``), else
        a view of it."""
        if self.same:
            return base
        offset = self.element_offset + start // self.dtype.itemsize
        if base.dtype is self.dtype:
            return base.as_strided(self.shape, self.stride, offset)
        out = torch.empty(0, dtype=self.dtype, device=base.device)  # a dtype view
        return out.set_(base.untyped_storage(), offset, self.shape, self.stride)


_orphan_lock = threading.Lock()


def _restore_without_manager(copy: _HostCopy) -> torch.Tensor:
    """The context manager was dropped while its graph lived on: bring the bytes back with
    a plain synchronous copy on the current stream (its copies out all completed by its
    ``__exit__``; no prefetch is left to use)."""
    with _orphan_lock:
        sibling = copy.live_restored()
        if sibling is not None:
            return sibling[0]
        restored = copy.to_device()
        copy.restored = (weakref.ref(restored.untyped_storage()), None)
        return restored
