"""What the graph owns: the handles the pack hook returns, the host copies they share, the
groups those travel in, and the record of the forward that made them.

The pack hook returns a handle (:class:`_Offloaded`, or :class:`_Kept` for what stays on
the device); the graph owns it, and it owns everything else: its :class:`_HostCopy` (the
bytes of one storage), whose :class:`_Group` holds a pool block with the bytes of the
copies saved one after another (returned when the last of them dies). A
:class:`_Forward` (the dedup map, and what the plan weighs) holds copies weakly. Nothing
here refers to the context manager strongly; see :mod:`leakfree.offload` for the lifetime
contract.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from leakfree.offload.pool import HostBlock, HostBlockPool


class Arrival(NamedTuple):
    """How a group's bytes reached the device: the event after which they are there, and
    the stream whose memory holds them (its allocator hands the memory out again in that
    stream's order; another stream that reads it must say so with ``record_stream``)."""

    event: Any
    home: Any


class _Restorer(Protocol):
    """What a handle asks of the manager that packed it (its backward passes:
    :class:`~leakfree.offload.backward.Backward`), which it holds weakly: bring its
    group's bytes back (and look ahead)."""

    def restore(self, handle: _Offloaded) -> torch.Tensor: ...

    def note(self, copy: _HostCopy) -> None: ...


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


class _Forward:
    """What a manager records of one forward: the storage dedup map, and what the plan
    weighs when the forward ends. Begun at the outermost ``__enter__``; ended at the
    outermost ``__exit__``, or, inside one ``with`` around many steps, by the first save
    after a backward pass began unpacking this manager's tensors (outside that pass), or
    once most of what it recorded has died (graphs dropped without backward): so it holds
    at most one forward's worth of entries, or about twice what is alive of it.

    ``shared``: later saves of a storage at the same version share the copy made of it.
    Keyed by address and version counter (an in-place write makes a new copy), and valid
    only while the storage it was copied from is alive (``copy.source``; an address is
    reused only after its storage died): no stale keys, nothing to clean up. Writes that
    bypass the version counter (through ``.data``, ``set_`` or numpy aliases) between two
    saves are not seen: PyTorch does not track them either. Everything here is held
    weakly or is a number: it owns no payload.
    """

    __slots__ = (
        "__weakref__",
        "alive",
        "began",
        "kept",
        "mark",
        "records",
        "shared",
        "sizes",
        "small",
        "spans",
    )

    def __init__(self, began: int = 0) -> None:
        #: (storage address, version) -> the copy made of it (weakly)
        self.shared: dict[tuple[int, int], weakref.ref[_HostCopy]] = {}
        #: the copies' sizes, in creation order (what the plan is made from); the copies of
        #: part of a storage (their index in ``sizes`` -> the storage: address, version,
        #: bytes); and the storages kept for their size (storage -> bytes)
        self.sizes: list[int] = []
        self.spans: dict[int, tuple[int, int, int]] = {}
        self.small: dict[tuple[int, int, int], int] = {}
        #: a forward whose plan moves nothing: its storages (address, version, bytes) ->
        #: the handles kept of each (weakly: the storage is kept while one lives)
        self.kept: dict[tuple[int, int, int], list[weakref.ref[_Kept]]] = {}
        #: the copies and kept handles made, and those of them alive; the record count at
        #: which to look again whether most of them died
        self.records = 0
        self.alive: weakref.WeakSet[Any] = weakref.WeakSet()
        self.mark = FORWARD_SLACK
        #: the backward passes begun through this manager's tensors when it began: once
        #: another begins, the next save outside a pass begins a new forward
        self.began = began

    def record(self, made: Any) -> None:
        """Count ``made`` (a new copy, or a kept handle) among this forward's records."""
        self.records += 1
        self.alive.add(made)

    def new_copy(
        self,
        t: torch.Tensor,
        storage: torch.UntypedStorage,
        key: tuple[int, int, int],
        whole: bool,
        span: tuple[int, int, int],
        exact: bool,
    ) -> tuple[_HostCopy, bool]:
        """A host copy of ``t``'s storage (``key``: its address, version and bytes), whole
        or of ``span`` (its first element, its bytes, the element size), recorded here;
        and whether ``t`` is exactly its bytes (:attr:`_Offloaded.same`; ``exact``: ``t``
        is its whole storage, contiguous from its start). A whole copy is the storage's
        for later saves once the caller has numbered it into :attr:`shared`."""
        _, version, total = key
        first, span_bytes, elem = span
        copy = _HostCopy(total if whole else span_bytes, 0 if whole else first * elem, t.device)
        copy.version = version
        self.record(copy)
        same = False
        if whole:
            if total % elem == 0:
                copy.dtype = t.dtype
                if exact:
                    copy.like = (t.dtype, t.shape)
                    same = True
            copy.source = weakref.ref(storage)
        sizes = self.sizes
        if not whole:  # the small-storage rule weighs the storage it keeps
            self.spans[len(sizes)] = key
        sizes.append(copy.nbytes)  # this forward's copies, for the plan
        return copy, same

    def weighed(self) -> tuple[list[int], list[int], list[int]]:
        """What the plan weighs of this forward: its copies' bytes in the order saved;
        each copy's storage bytes (a span's storage may be larger than the span); and
        every storage it saved, once (whole copies are one per storage, the dedup map;
        spans of one storage, or of a storage copied whole, count once more; and the
        small storages it kept)."""
        sizes, spans, shared = self.sizes, self.spans, self.shared
        storages = [spans[i][2] if i in spans else n for i, n in enumerate(sizes)]
        saved = [n for i, n in enumerate(sizes) if i not in spans]
        saved += [key[2] for key in set(spans.values()) if key[:2] not in shared]
        saved += self.small.values()
        return sizes, storages, saved

    def outlived(self) -> bool:
        """Whether most of what this forward recorded has died (its ``records`` are past
        ``mark``); else the next mark, from what is alive."""
        live = len(self.alive)
        if self.records > 2 * live + FORWARD_SLACK:
            return True
        self.mark = 2 * live + FORWARD_SLACK
        return False


#: a forward's record may hold this many entries more than twice what is alive of it
FORWARD_SLACK = 64


#: where each host copy starts in its group's block: a multiple of every dtype's size, so a
#: member comes back as a strided view of the group's device tensor
_ALIGN = 64


class _Group:
    """Host copies made one after another in one forward, sent to the host together into
    one host block, and brought back to the device together by one transfer.

    Small copies cost more in fixed overhead (a transfer, its stream switches and events, a
    device allocation, a pool block, the bookkeeping) than in bytes; grouped, they cost
    one of each per group. A group holds copies of one dtype and one device, up to its
    capacity (``batch_bytes``); a copy as large as that has a group of its own. Members are
    saved one after another in forward, so backward needs them one after another too.

    Two states. *Open*: copies join it (``unsent``: each with the device tensor it reads,
    held until sent); *sent*: ``block`` (exactly the size its copies need) holds their
    bytes, and nothing joins any more. The graph owns it through its copies: the block goes
    back to the pool when the last of them dies. In a backward pass the group's device
    tensor is kept (``keep``) until every handle of its copies has been unpacked in that
    pass, so it comes back once per pass; the pass's end drops whatever is left (handles
    a partial pass never reached).
    """

    __slots__ = (
        "__weakref__",
        "block",
        "capacity",
        "device",
        "dtype",
        "end",
        "keep",
        "largest",
        "lent",
        "like",
        "pool",
        "prefetched",
        "remaining",
        "restored",
        "sent",
        "seq",
        "task",
        "unsent",
        "used",
        "users",
        "views",
        "written",
    )

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.block: HostBlock | None = None  # taken when sent
        self.pool: Any = None  # weak reference to the pool the block returns to
        self.capacity = capacity
        self.dtype = dtype
        self.device = device
        self.used = 0  # bytes of the block its copies use, padding included
        self.end = 0  # where the next copy would start: ``used`` rounded up to _ALIGN
        self.largest = 0  # its largest copy's bytes
        #: the copies waiting to be sent (weakly: one whose graph died needs no bytes), with
        #: the device tensors they read and the saved tensor (for its version counter)
        self.unsent: list[tuple[weakref.ref[_HostCopy], torch.Tensor, torch.Tensor]] = []
        #: (dtype, shape) while its one copy is exactly these bytes (``_HostCopy.like``):
        #: it then comes back as that copy's tensor, which its handles of that geometry
        #: return as it is (no view: one device op fewer each)
        self.like: tuple[torch.dtype, torch.Size] | None = None
        self.seq = 0  # its first copy's creation number
        self.users = 0  # handles made for its copies
        self.lent = False  # restored tensors view the block itself (CPU): never reuse it
        #: (weak reference to the restored storage, its Arrival; None when no copy ran): the
        #: storage, since what autograd keeps of an unpacked tensor may be another tensor
        #: object over it (a double-backward graph)
        self.restored: tuple[Any, Any] | None = None
        #: (device bytes, their arrival) brought back ahead of use
        self.prefetched: tuple[torch.Tensor, Arrival | None] | None = None
        self.written: Any = None  # the event its copies out recorded (None: synchronous)
        self.sent = -1  # its place in its manager's order of sends (-1: not sent)
        #: the backward pass (graph task id) that last unpacked it, the device tensor kept
        #: for that pass's other handles, and how many are still to unpack
        self.task = -1
        self.keep: torch.Tensor | None = None
        self.remaining = 0
        #: the views of ``keep`` handed out in that pass, by geometry (dropped with it)
        self.views: dict[Any, torch.Tensor] | None = None

    def fits(self, copy: _HostCopy) -> bool:
        """Whether ``copy`` (of the group's dtype and device) may join: not sent, and
        room left."""
        return self.block is None and self.end + copy.nbytes <= self.capacity

    def add(
        self,
        copy: _HostCopy,
        ref: weakref.ref[_HostCopy],
        src: torch.Tensor,
        saved: torch.Tensor,
    ) -> None:
        """Place ``copy`` (``ref``: a weak reference to it), whose bytes ``src`` reads (of
        ``saved``, the tensor saved), at the next aligned offset."""
        offset = self.end
        nbytes = copy.nbytes
        copy.group = self
        copy.offset = offset
        if offset == 0:  # its first copy names it, and may be its whole tensor
            self.seq = copy.seq
            self.like = copy.like
        else:
            self.like = None
        used = self.used = offset + nbytes
        self.end = -(-used // _ALIGN) * _ALIGN
        if nbytes > self.largest:
            self.largest = nbytes
        self.users += copy.users
        self.unsent.append((ref, src, saved))

    def take_block(
        self, pool: HostBlockPool
    ) -> tuple[HostBlock, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Take a host block for the bytes (the group is sent: nothing joins any more);
        returns it, and (host bytes as they are copied, what they are copied
        from) for each copy still alive. A copy whose saved tensor was written in place
        since it was saved is marked ``stale`` (its unpack reports it)."""
        # Weak: a graph keeps its own host bytes, not the pool and its free blocks.
        self.pool = weakref.ref(pool)
        block = self.block = pool.acquire(self.used)
        pairs = []
        for ref, src, saved in self.unsent:
            copy = ref()
            if copy is None:
                continue
            if saved._version != copy.version:
                copy.stale = saved._version  # these are not the bytes that were saved
            like = copy.like
            if like is not None:  # its own shape: src is the whole tensor as it is
                typed = block.view(copy.nbytes, like[0], like[1], copy.offset)
            else:
                typed = block.view(copy.nbytes, copy.dtype, None, copy.offset)
            pairs.append((typed, src))
        self.unsent = []
        return block, pairs

    def on_host(self) -> torch.Tensor:
        """The host bytes its copies use, as they are copied back: its one copy's tensor
        (``like``), or flat of ``dtype``; only once sent."""
        block = self.block
        if block is None:
            raise RuntimeError(
                "leakfree: a group of host copies was read back before it was sent; "
                "please report this"
            )
        like = self.like
        if like is not None:
            return block.view(self.used, like[0], like[1])
        return block.view(self.used, self.dtype)

    def to_device(self, non_blocking: bool = False) -> torch.Tensor:
        """A new device tensor holding these bytes, copied on the current stream."""
        host = self.on_host()
        dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        return dev.copy_(host, non_blocking=non_blocking)

    def live_restored(self) -> tuple[torch.Tensor, Any] | None:
        """The device tensor a sibling handle restored, if its storage is still alive (as
        it was copied back: ``on_host``'s dtype and shape), and the event of that copy-in."""
        if self.restored is None:
            return None
        storage = self.restored[0]()
        if storage is None:
            return None
        host = self.on_host()
        dev = torch.empty(0, dtype=host.dtype, device=self.device)
        return dev.set_(storage, 0, host.shape, host.stride()), self.restored[1]

    def __del__(self) -> None:
        block = getattr(self, "block", None)
        pool = self.pool() if block is not None else None
        if block is not None and pool is not None:
            # never blocks: safe inside a garbage collection
            pool.release(block, reuse=not self.lent)
        # (pool gone: the block's memory is freed with it)


class _HostCopy:
    """The bytes of (a span of) one device storage, shared by the handles that use them.

    Two states. *Held on the device* (a device budget keeps it there): ``pending`` is the
    detached device tensor and nothing is copied. *Moved*: its bytes go to a
    :class:`_Group`'s block, from ``offset`` on, and come back with the group.
    Moving from the first state to the second is the copy out; there is no way back.
    """

    __slots__ = (
        "__weakref__",
        "byte_start",
        "device",
        "dtype",
        "group",
        "like",
        "nbytes",
        "offset",
        "pending",
        "seq",
        "source",
        "stale",
        "task",
        "users",
        "version",
    )

    def __init__(self, nbytes: int, byte_start: int, device: torch.device) -> None:
        self.group: _Group | None = None  # where its bytes went (None: not moved)
        self.offset = 0  # where they start in the group's block (and its restored tensor)
        self.nbytes = nbytes
        self.byte_start = byte_start  # where the copied bytes start in the source storage
        self.device = device
        self.dtype = torch.uint8  # what it is copied back as: its first tensor's, if whole
        self.users = 0  # handles made for it
        self.seq = 0  # creation order, across every forward of the manager
        #: the backward pass that last unpacked it while a device budget held it
        self.task = -1
        #: (dtype, shape) when its first handle's tensor is exactly these bytes (contiguous,
        #: from the start): copied as that tensor, and, alone in its group, brought back as it
        self.like: tuple[torch.dtype, torch.Size] | None = None
        self.version = 0  # the source's version counter when saved
        self.source: Any = None  # weak reference to the source storage (dedup validity)
        self.pending: torch.Tensor | None = None  # held on the device: the saved tensor
        #: the source's version counter when sent, if a write in place came in between
        #: (its unpack reports it, as PyTorch would have): its bytes were not the saved ones
        self.stale: int | None = None


class _Offloaded:
    """The packed form of one saved tensor: the graph owns it, and it owns everything."""

    __slots__ = (
        "__weakref__",
        "copy",
        "dtype",
        "element_offset",
        "manager",
        "same",
        "shape",
        "stride",
        "task",
    )

    def __init__(
        self,
        manager: Callable[[], _Restorer | None],  # a weak reference
        copy: _HostCopy,
        t: torch.Tensor,
        element_offset: int,
        same: bool,
    ) -> None:
        # Weak, like the hooks: a graph keeps its payloads, never the context manager.
        self.manager = manager
        self.copy = copy
        copy.users += 1
        group = copy.group
        if group is not None:
            group.users += 1
        self.dtype = t.dtype
        self.shape = t.shape
        self.stride = t.stride()
        #: the copy's tensor (``like``) is this handle's as it is (contiguous, from the
        #: start, of its dtype and shape): no view to make of the held tensor, or of the
        #: restored one while the copy is alone in its group
        self.same = same
        self.element_offset = element_offset  # storage offset within the copied bytes
        self.task = -1  # the backward pass that last unpacked it

    def unpack(self) -> torch.Tensor:
        copy = self.copy
        held = copy.pending
        if held is not None:  # a device budget kept it: a view of the saved tensor
            if held._version != copy.version:  # the version it was saved at, as t's
                raise _version_error(held._version, copy.version, self.shape)
            manager = self.manager()
            if manager is not None:
                manager.note(copy)  # its place in the pass's order, for later prefetch
            return self.view_of(held, copy.byte_start, self.same)
        if copy.stale is not None:
            raise _version_error(copy.stale, copy.version, self.shape)
        manager = self.manager()
        if manager is not None:
            return manager.restore(self)
        # dropped while its graph lives on: a plain synchronous copy back
        group = copy.group
        base = _restore_without_manager(group)
        alone = group is not None and group.like is not None  # as _restore decides
        return self.view_of(base, copy.offset, self.same and alone)

    def view_of(self, base: torch.Tensor, start: int, same: bool) -> torch.Tensor:
        """This handle's tensor over ``base``, a device tensor whose storage holds the
        copy's bytes from byte ``start`` on (its place in the group restored; or
        ``byte_start``, held on the device): ``base`` itself when it is exactly the
        handle's tensor (``same``), else a view of it."""
        if same:
            return base
        offset = self.element_offset + start // self.dtype.itemsize
        if base.dtype is self.dtype:
            return base.as_strided(self.shape, self.stride, offset)
        out = torch.empty(0, dtype=self.dtype, device=base.device)  # a dtype view
        return out.set_(base.untyped_storage(), offset, self.shape, self.stride)


_orphan_lock = threading.Lock()


def _restore_without_manager(group: _Group | None) -> torch.Tensor:
    """The context manager was dropped while its graph lived on: bring the group's bytes
    back with a plain synchronous copy on the current stream, once that stream has waited
    for the group's copies out (no prefetch is left to use)."""
    if group is None or group.block is None:  # its manager's __exit__ sent every group
        raise RuntimeError(
            "leakfree: a saved tensor was unpacked before it was moved to the host or "
            "held on the device; please report this"
        )
    with _orphan_lock:
        sibling = group.live_restored()
        if sibling is not None:
            return sibling[0]
        if group.written is not None:  # its copies out ran on a side stream
            group.written.wait()
        restored = group.to_device()
        group.restored = (weakref.ref(restored.untyped_storage()), None)
        return restored
