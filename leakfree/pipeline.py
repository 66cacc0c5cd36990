"""Pipeline-parallel receive buffers that autograd never ties to accumulation.

A pipeline stage receives an activation into a buffer, runs forward on it, and later sends
the buffer's gradient back. The usual way makes the buffer an autograd *leaf*
(``buf.requires_grad_()``): its gradient then accumulates in ``buf.grad`` (kept until
someone clears it), reused buffers collect tensor hooks across steps, every microbatch
gets its own buffer for the whole run, and in one C++ framework the leaf and its
accumulation node formed a reference cycle that kept every step's graph alive.

Here the received activation is a *non-leaf* view of the buffer, made by
:func:`as_nonleaf`: its backward hands the gradient to a :class:`GradSlot` and returns
nothing, so there is no accumulation node for the buffer and no ``.grad`` anywhere.

Lifetime contract
-----------------
*The buffer* is referenced by the non-leaf activation (an alias) and by whatever saved
it for backward; :class:`RecvBufferPool` takes it back only after its slot has delivered
(the stage's backward through it is complete) or its graph was dropped, so a buffer still
needed by backward is never overwritten.
*The gradient* is held by the slot until ``take()`` (or passed straight to its callback);
autograd keeps nothing.
*A sent output* can be freed right after the send with :func:`release_output`; the
returned handle keeps only the graph edge needed by :func:`backward_from`.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from leakfree._warnings import LeakfreeWarning
from leakfree.function import Function

__all__ = [
    "GradSlot",
    "PipelineAborted",
    "PipelineTimeout",
    "PipelineWarning",
    "RecvBuffer",
    "RecvBufferPool",
    "ReleasedOutput",
    "ScheduleResult",
    "as_nonleaf",
    "backward_from",
    "recv_backward",
    "recv_forward",
    "release_output",
    "run_schedule",
    "send_abort",
    "send_backward",
    "send_forward",
]


class PipelineWarning(LeakfreeWarning):
    """A pipeline primitive could not do what it promised (and did nothing instead)."""


class PipelineAborted(RuntimeError):
    """A peer stage failed: it told this stage so instead of leaving it waiting."""


class PipelineTimeout(TimeoutError):
    """A receive or a send did not complete within the schedule's ``timeout``."""


# --- gradient slots and non-leaf receive ------------------------------------------------------


class GradSlot:
    """Where the gradient of a received activation goes.

    ``deliver(g)`` (called by autograd through :func:`as_nonleaf`) stores ``g``, or passes it
    to ``callback`` when one is given. ``take()`` returns the stored gradient and forgets
    it. A second gradient before ``take()`` raises ``RuntimeError`` unless
    ``accumulate=True`` (then they are summed, as ``.grad`` would be).

    ``on_delivered`` callbacks (used by :class:`RecvBufferPool`) run after each delivery.
    """

    __slots__ = ("__weakref__", "_grad", "accumulate", "callback", "deliveries", "on_delivered")
    # It sits on an as_nonleaf ctx and holds gradients, never that node's output: the
    # output-on-ctx walk (leakfree._walk.OPAQUE) need not follow its callbacks.
    __leakfree_opaque__ = True

    def __init__(
        self,
        callback: Callable[[torch.Tensor], None] | None = None,
        *,
        accumulate: bool = False,
    ) -> None:
        self.callback = callback
        self.accumulate = accumulate
        self._grad: torch.Tensor | None = None
        self.deliveries = 0
        self.on_delivered: list[Callable[[GradSlot], None]] = []

    @property
    def ready(self) -> bool:
        """A gradient is waiting to be taken."""
        return self._grad is not None

    def deliver(self, grad: torch.Tensor) -> None:
        if self.callback is not None:
            self.callback(grad)
        elif self._grad is None:
            self._grad = grad
        elif self.accumulate:
            self._grad = self._grad + grad
        else:
            raise RuntimeError(
                "GradSlot received a second gradient before take(): the activation was "
                "backpropagated twice (retain_graph=True?). take() the first one, or make "
                "the slot with GradSlot(accumulate=True) to sum them."
            )
        self.deliveries += 1
        for fn in self.on_delivered:
            fn(self)

    def take(self) -> torch.Tensor:
        """Return the delivered gradient and forget it."""
        grad = self._grad
        if grad is None:
            raise RuntimeError(
                "GradSlot.take(): no gradient was delivered yet (run the stage's backward "
                "first, or the slot forwards to a callback)"
            )
        self._grad = None
        return grad

    def __repr__(self) -> str:
        state = "callback" if self.callback else ("ready" if self.ready else "empty")
        return f"GradSlot({state}, deliveries={self.deliveries})"


class _ToSlot(Function):
    """Identity on the buffer; its backward hands the gradient to the slot.

    The anchor is a zero-element leaf that requires grad: a custom Function's output
    requires grad only if an input does, and the buffer must not. Backward returns
    nothing for either input, so the anchor never gets a ``.grad`` and no accumulation
    node ever runs. ``ctx.slot`` is released after backward (leakfree.Function).
    """

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, buf: torch.Tensor, slot: GradSlot) -> torch.Tensor:
        ctx.slot = slot
        # An alias, not a view: it shares storage and version counter with the buffer (so
        # autograd still catches an overwrite before backward), and in-place ops on the
        # activation stay allowed.
        return buf.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.slot.deliver(grad)
        return None, None, None


_anchors: dict[torch.device, torch.Tensor] = {}
_anchors_lock = threading.Lock()


def _anchor(device: torch.device) -> torch.Tensor:
    anchor = _anchors.get(device)
    if anchor is None:
        with _anchors_lock:
            anchor = _anchors.setdefault(device, torch.empty(0, device=device, requires_grad=True))
    return anchor


def as_nonleaf(buf: torch.Tensor, slot: GradSlot) -> torch.Tensor:
    """A non-leaf tensor with ``buf``'s data whose gradient goes to ``slot``.

    The result has a ``grad_fn`` and ``is_leaf`` False; it aliases ``buf`` (no copy).
    Its backward calls ``slot.deliver(grad)`` and nothing else: no accumulation node for
    the buffer, no ``.grad``, nothing retained by autograd afterwards.

    Raises ``ValueError`` if ``buf`` requires grad (it would be an autograd leaf itself).
    """
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"as_nonleaf(buf=...): expected a tensor, got {type(buf).__name__}")
    if buf.requires_grad:
        raise ValueError(
            "as_nonleaf(buf=...): the buffer requires grad, so it is (or belongs to) an "
            "autograd graph of its own; receive into a plain buffer (buf.detach() or a "
            "RecvBufferPool buffer)"
        )
    if not isinstance(slot, GradSlot):
        raise TypeError(f"as_nonleaf(slot=...): expected a GradSlot, got {type(slot).__name__}")
    if not (buf.is_floating_point() or buf.is_complex()):
        raise ValueError(
            f"as_nonleaf(buf=...): dtype {buf.dtype} cannot carry a gradient; only "
            "floating point (or complex) activations can be backpropagated"
        )
    if torch.is_grad_enabled():
        out: torch.Tensor = _ToSlot.apply(_anchor(buf.device), buf, slot)
        return out
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "as_nonleaf under torch.inference_mode(): no gradient can flow back, so there is "
            "nothing to deliver; use the received buffer directly"
        )
    with torch.enable_grad():  # under no_grad (evaluation) too: it must be a non-leaf
        out = _ToSlot.apply(_anchor(buf.device), buf, slot)
    return out


# --- receive buffer pool ----------------------------------------------------------------------


@dataclass
class RecvBuffer:
    """A pool buffer, its slot, and the non-leaf activation made from them."""

    tensor: torch.Tensor
    slot: GradSlot
    activation: torch.Tensor | None = None
    key: tuple[Any, ...] = field(default=(), repr=False)


@dataclass
class PoolCounters:
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

    @property
    def free_buffers(self) -> int:
        return sum(len(v) for v in self._free.values())


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


# --- sending side: free sent outputs, backpropagate later -------------------------------------

_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)
_increment_version: Callable[[torch.Tensor], None] = getattr(
    torch.autograd.graph, "increment_version", torch._C._increment_version
)


@dataclass(frozen=True)
class ReleasedOutput:
    """What :func:`backward_from` needs once an output's storage was released."""

    edge: GradientEdge
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    freed: bool
    held_bytes: int = 0  #: bytes still held because the storage could not be freed


def _others_hold(t: torch.Tensor) -> bool | None:
    """Does anything besides ``t`` hold its storage? None if this torch cannot tell."""
    if _use_count is None:
        return None
    # One reference from the tensor, one from the temporary storage object made here.
    return int(_use_count(t.untyped_storage()._cdata)) > 2


_RELEASED_MARK = "_leakfree_released_output"


def release_output(y: torch.Tensor) -> ReleasedOutput:
    """Free the storage of an output that was sent to the next stage; keep its graph.

    Returns a :class:`ReleasedOutput` holding the output's gradient edge (public API,
    ``torch.autograd.graph.get_gradient_edge``), which keeps the graph alive for
    :func:`backward_from`. ``y`` is left holding an empty storage (its memory is freed;
    reading it gives an empty tensor) and its version is bumped, so a later node that
    saved ``y`` as an input fails with autograd's in-place error rather than reading
    garbage. If anything else still references the storage (a node saved ``y`` as its
    output, a view of it is alive), nothing is freed and a :class:`PipelineWarning` says
    so.

    Only call it once the send has completed (for ``isend``, after ``work.wait()`` or
    ``is_completed()``). Refuses leaves (parameters, inputs: they have no graph to keep) and
    a second call on the same output, before changing anything.
    """
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"release_output(y=...): expected a tensor, got {type(y).__name__}")
    if not y.requires_grad:
        raise ValueError(
            "release_output(y=...): the output does not require grad, so there is no "
            "backward to run later; just drop it"
        )
    if y.is_leaf:
        what = "a parameter" if isinstance(y, torch.nn.Parameter) else "a leaf tensor"
        raise ValueError(
            f"release_output(y=...): y is {what} {tuple(y.shape)}, not the output of a "
            "stage's forward. release_output frees the storage of an activation that was "
            "sent to the next stage, keeping its graph for backward_from; a leaf has no "
            "graph, and emptying it would break whatever uses it next"
        )
    if y.__dict__.get(_RELEASED_MARK):
        raise ValueError(
            f"release_output(y=...): this output was already released (it was "
            f"{y.__dict__[_RELEASED_MARK]}); use the ReleasedOutput the first call returned"
        )
    edge = get_gradient_edge(y)
    held = _others_hold(y)
    freed = held is False and y._base is None
    nbytes = y.untyped_storage().nbytes()
    shape, dtype, device = y.shape, y.dtype, y.device
    if freed:
        # Swap in an empty storage rather than resizing the old one to 0: whatever holds
        # this very tensor (a later node that saved it as an input, a user's list) then sees
        # a valid empty tensor, and the version bump makes such a node raise autograd's
        # "modified by an inplace operation" instead of reading freed memory.
        y.data = torch.empty((0,), dtype=dtype, device=device)
        _increment_version(y)
    else:
        why = (
            "this torch cannot count storage references"
            if held is None
            else "it is a view"
            if y._base is not None
            else "its storage is still referenced elsewhere (saved for backward, or a view)"
        )
        warnings.warn(
            f"release_output: not freeing the output's storage ({tuple(shape)}, "
            f"{dtype}): {why}. Its memory stays until the graph is done with it.",
            PipelineWarning,
            stacklevel=2,
        )
    # What it was, for the error a second call gets (a string: no reference to the graph).
    y.__dict__[_RELEASED_MARK] = f"{tuple(shape)}, {dtype}"
    return ReleasedOutput(edge, shape, dtype, device, freed, 0 if freed else nbytes)


def backward_from(handle: ReleasedOutput, grad: torch.Tensor) -> None:
    """Run the backward of a released output with the gradient the next stage sent."""
    if not isinstance(handle, ReleasedOutput):
        raise TypeError(
            f"backward_from(handle=...): expected what release_output returned, got "
            f"{type(handle).__name__}"
        )
    if grad.shape != handle.shape or grad.dtype != handle.dtype or grad.device != handle.device:
        raise ValueError(
            f"backward_from: gradient {tuple(grad.shape)} {grad.dtype} on {grad.device} does "
            f"not match the released output {tuple(handle.shape)} {handle.dtype} on "
            f"{handle.device}"
        )
    torch.autograd.backward(handle.edge, grad_tensors=grad)  # type: ignore[arg-type]


# --- point-to-point over torch.distributed ----------------------------------------------------

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_MAX_DIMS = 8
_HEADER = 2 + _MAX_DIMS  # dtype code, ndim, dims
#: The dtype code of a header that carries no tensor: the sender failed and stops.
_ABORT = -1


def _wait(work: Any, timeout: float | None, what: str) -> None:
    """``work.wait()``, bounded by ``timeout`` seconds when given."""
    if timeout is None:
        work.wait()
        return
    try:
        completed = work.wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as e:  # gloo reports a timeout as an error
        raise PipelineTimeout(f"{what}: nothing after {timeout:g} s ({e})") from None
    if completed is False:
        raise PipelineTimeout(f"{what}: nothing after {timeout:g} s")


def _recv(buf: torch.Tensor, src: int, group: Any, timeout: float | None, what: str) -> None:
    import torch.distributed as dist

    if timeout is None:
        dist.recv(buf, src, group=group)
    else:
        _wait(dist.irecv(buf, src, group=group), timeout, f"{what} from rank {src}")


def send_abort(dst: int, *, group: Any = None) -> Any:
    """Tell stage ``dst`` that this stage failed: its next receive from us raises
    :class:`PipelineAborted` instead of waiting. Returns the ``isend`` work (not waited:
    the peer may never receive it)."""
    import torch.distributed as dist

    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0] = _ABORT
    return dist.isend(header, dst, group=group)


class _Pending:
    """Sends in flight (isend) and what to run once each completes.

    The payload (an alias of the sent tensor) is dropped *before* ``then`` runs: otherwise
    ``release_output`` would see it as another holder of the storage and refuse.
    """

    def __init__(self) -> None:
        self.works: list[list[Any]] = []  # [work, payload, then]

    def add(self, work: Any, keep: torch.Tensor, then: Callable[[], None] | None = None) -> None:
        self.works.append([work, keep, then])

    def _finish(self, entry: list[Any], timeout: float | None = None) -> None:
        _wait(entry[0], timeout, "a send")
        then = entry[2]
        entry.clear()  # the payload reference goes first
        if then is not None:
            then()

    def poll(self) -> None:
        done = [e for e in self.works if e[0].is_completed()]
        self.works = [e for e in self.works if e not in done]
        for entry in done:
            self._finish(entry)

    def wait_all(self, timeout: float | None = None) -> None:
        works, self.works = self.works, []
        for entry in works:
            self._finish(entry, timeout)


def _header(t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in _DTYPES:
        raise ValueError(f"pipeline p2p: dtype {t.dtype} is not supported; use one of {_DTYPES}")
    if t.dim() > _MAX_DIMS:
        raise ValueError(
            f"pipeline p2p: at most {_MAX_DIMS} dimensions, got shape {tuple(t.shape)}"
        )
    values = [_DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (_MAX_DIMS - t.dim())
    return torch.tensor(values, dtype=torch.int64, device=t.device)


def _send(
    t: torch.Tensor,
    dst: int,
    group: Any,
    pending: _Pending | None,
    then: Callable[[], None] | None = None,
) -> None:
    import torch.distributed as dist

    payload = t.detach().contiguous()
    header = _header(payload)
    if pending is None:
        dist.send(header, dst, group=group)
        dist.send(payload, dst, group=group)
        del payload  # not a holder of the storage any more (see _Pending)
        if then is not None:
            then()
    else:
        pending.add(dist.isend(header, dst, group=group), header)
        pending.add(dist.isend(payload, dst, group=group), payload, then)


def _recv_header(
    src: int, device: torch.device, group: Any, timeout: float | None, what: str
) -> tuple[tuple[int, ...], torch.dtype]:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    _recv(header, src, group, timeout, what)
    values = header.tolist()
    code, ndim = int(values[0]), int(values[1])
    if code == _ABORT:
        raise PipelineAborted(
            f"{what}: rank {src} failed and stopped the schedule (its own error is in its "
            "log); this stage stops too"
        )
    if not (0 <= code < len(_DTYPES) and 0 <= ndim <= _MAX_DIMS):
        raise ValueError(
            f"pipeline p2p: rank {src} sent a header leakfree cannot read ({values}); are "
            "both sides using leakfree's send/recv helpers, in the same order?"
        )
    return tuple(int(v) for v in values[2 : 2 + ndim]), _DTYPES[code]


def _recv_into(
    src: int,
    group: Any,
    device: torch.device,
    shape: Sequence[int] | None,
    dtype: torch.dtype | None,
    what: str,
    make: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
    timeout: float | None = None,
) -> torch.Tensor:
    sent_shape, sent_dtype = _recv_header(src, device, group, timeout, what)
    if (shape is not None and tuple(shape) != sent_shape) or (
        dtype is not None and dtype != sent_dtype
    ):
        scratch = torch.empty(sent_shape, dtype=sent_dtype, device=device)
        _recv(scratch, src, group, timeout, what)  # drain it: the sender is not left hanging
        raise ValueError(
            f"{what}: rank {src} sent {sent_shape} {sent_dtype}, but the receiving buffer is "
            f"{tuple(shape) if shape is not None else sent_shape} "
            f"{dtype if dtype is not None else sent_dtype}"
        )
    buf = make(sent_shape, sent_dtype)
    _recv(buf, src, group, timeout, what)
    # recv writes without bumping the version counter: bump it, so that an alias of this
    # (reused) buffer still saved by a retained graph raises instead of reading new data.
    _increment_version(buf)
    return buf


def send_forward(
    activation: torch.Tensor,
    dst: int,
    *,
    group: Any = None,
    pending: _Pending | None = None,
    then: Callable[[], None] | None = None,
) -> None:
    """Send a stage's output to stage ``dst`` (a header with shape and dtype, then data).

    Blocking by default; with ``pending`` (used by :func:`run_schedule`) the sends are
    ``isend`` and ``then`` runs once the data has left (e.g. to release the output).
    """
    _send(activation, dst, group, pending, then)


def recv_forward(
    src: int,
    *,
    pool: RecvBufferPool | None = None,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    group: Any = None,
    callback: Callable[[torch.Tensor], None] | None = None,
    timeout: float | None = None,
) -> RecvBuffer:
    """Receive an activation from ``src`` into a pool buffer; return it as a non-leaf.

    ``shape`` / ``dtype``, when given, are checked against what was sent (a mismatch is a
    ``ValueError`` naming both). The returned :class:`RecvBuffer` has ``activation`` (the
    non-leaf to run forward on) and ``slot`` (where its gradient will be). ``timeout``
    (seconds) bounds the wait: :class:`PipelineTimeout` after it; a peer that failed and
    said so (:func:`send_abort`) raises :class:`PipelineAborted` at once.
    """
    dev = torch.device(device)
    pool = pool if pool is not None else RecvBufferPool()
    holder: dict[str, RecvBuffer] = {}

    def make(s: tuple[int, ...], d: torch.dtype) -> torch.Tensor:
        entry = pool.acquire(s, d, dev, callback=callback)
        holder["entry"] = entry
        return entry.tensor

    _recv_into(src, group, dev, shape, dtype, "recv_forward", make, timeout)
    return holder["entry"]


def send_backward(
    grad: torch.Tensor, dst: int, *, group: Any = None, pending: _Pending | None = None
) -> None:
    """Send the gradient of a received activation back to stage ``dst``."""
    _send(grad, dst, group, pending)


def recv_backward(
    src: int,
    *,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    group: Any = None,
    timeout: float | None = None,
) -> torch.Tensor:
    """Receive the gradient of this stage's output from ``src`` (checked, bounded and
    aborted like :func:`recv_forward`)."""
    dev = torch.device(device)
    return _recv_into(
        src,
        group,
        dev,
        shape,
        dtype,
        "recv_backward",
        lambda s, d: torch.empty(s, dtype=d, device=dev),
        timeout,
    )


# --- a small schedule runner ------------------------------------------------------------------


@dataclass
class ScheduleResult:
    """What :func:`run_schedule` returns on each stage."""

    losses: list[float]  #: last stage: each microbatch's loss (empty elsewhere)
    live_bytes: list[int]  #: after each microbatch's backward: buffers + unreleased outputs
    pool: RecvBufferPool
    freed_outputs: int = 0  #: sent outputs whose storage release_output freed


def run_schedule(
    stage: Callable[[torch.Tensor], torch.Tensor],
    *,
    stage_id: int,
    num_stages: int,
    num_microbatches: int,
    inputs: Callable[[int], torch.Tensor] | None = None,
    loss_fn: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    schedule: str = "1f1b",
    ranks: Sequence[int] | None = None,
    group: Any = None,
    device: torch.device | str = "cpu",
    timeout: float | None = None,
) -> ScheduleResult:
    """Run forward and backward of ``num_microbatches`` through a pipeline of stages.

    The reference wiring of the primitives above, not a training framework: stage
    ``stage_id`` runs ``stage`` on activations received (as non-leaves, from a
    :class:`RecvBufferPool`) from the previous stage, sends its outputs to the next one and
    releases them once sent; gradients come back through :class:`GradSlot` and
    :func:`backward_from`. The first stage reads ``inputs(i)``; the last computes
    ``loss_fn(output, i)`` and backpropagates it. ``schedule`` is ``"gpipe"`` (all forwards,
    then all backwards) or ``"1f1b"`` (warm-up forwards, then one forward / one backward,
    then cool-down backwards). Backward runs in microbatch order on every stage, so
    gradients accumulate in the same order as a single-process loop.

    Sends are ``isend`` (no deadlock between a send and the peer's send), completed
    before their output is released; receives block.

    Failure is bounded. If this stage raises (in ``stage``, ``loss_fn``, ``inputs`` or a
    receive), it sends an abort to its neighbours before re-raising, so a peer waiting on
    it raises :class:`PipelineAborted` at once rather than at the process group's timeout
    (30 minutes by default), and passes the abort on. ``timeout`` (seconds) bounds every
    receive and send wait: a peer that is stuck rather than failed gives
    :class:`PipelineTimeout` after it. As after the process group's own timeout, the
    group may then be unusable (gloo closes the connection whose receive timed out):
    treat it as fatal for the job, and restart.
    """
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"run_schedule(schedule={schedule!r}): use 'gpipe' or '1f1b'")
    if not 0 <= stage_id < num_stages:
        raise ValueError(f"run_schedule(stage_id={stage_id}): not in [0, {num_stages})")
    if num_microbatches < 1:
        raise ValueError(f"run_schedule(num_microbatches={num_microbatches}): must be >= 1")
    first, last = stage_id == 0, stage_id == num_stages - 1
    if first and inputs is None:
        raise ValueError("run_schedule: the first stage needs inputs=")
    if last and loss_fn is None:
        raise ValueError("run_schedule: the last stage needs loss_fn=")
    ranks = list(ranks) if ranks is not None else list(range(num_stages))
    prev_rank = None if first else ranks[stage_id - 1]
    next_rank = None if last else ranks[stage_id + 1]
    dev = torch.device(device)
    pool = RecvBufferPool()
    pending = _Pending()
    received: dict[int, RecvBuffer] = {}
    sent: dict[int, ReleasedOutput | torch.Tensor] = {}
    losses: list[float] = []
    live: list[int] = []
    freed = 0

    def forward(i: int) -> None:
        if first:
            assert inputs is not None
            x = inputs(i)
        else:
            assert prev_rank is not None
            entry = recv_forward(prev_rank, pool=pool, device=dev, group=group, timeout=timeout)
            assert entry.activation is not None
            x, entry.activation = entry.activation, None  # the graph holds it from here on
            received[i] = entry
        y = stage(x)
        if last:
            assert loss_fn is not None
            sent[i] = loss_fn(y, i)
        else:
            assert next_rank is not None
            sent[i] = y
            # Free the output's memory as soon as its data has left (Megatron's trick).
            send_forward(y, next_rank, group=group, pending=pending, then=_releaser(sent, i))
        del x, y
        pending.poll()

    def backward(i: int) -> None:
        nonlocal freed
        if last:
            loss = sent.pop(i)
            assert isinstance(loss, torch.Tensor)
            losses.append(float(loss.detach()))
            loss.backward()  # type: ignore[no-untyped-call]
            del loss
        else:
            assert next_rank is not None
            if isinstance(sent[i], torch.Tensor):
                pending.wait_all(timeout)  # its send is still in flight: finish it (and release)
            out = sent.pop(i)
            assert isinstance(out, ReleasedOutput)
            freed += out.freed
            grad = recv_backward(next_rank, device=dev, group=group, timeout=timeout)
            backward_from(out, grad)
        if not first:
            assert prev_rank is not None
            entry = received.pop(i)
            send_backward(entry.slot.take(), prev_rank, group=group, pending=pending)
        pending.poll()
        live.append(pool.counters.allocated_bytes + _unreleased_bytes(sent))

    try:
        if schedule == "gpipe":
            for i in range(num_microbatches):
                forward(i)
            for i in range(num_microbatches):
                backward(i)
        else:
            warmup = min(num_stages - stage_id - 1, num_microbatches)
            for i in range(warmup):
                forward(i)
            for i in range(warmup, num_microbatches):
                forward(i)
                backward(i - warmup)
            for i in range(num_microbatches - warmup, num_microbatches):
                backward(i)
        pending.wait_all(timeout)
    except BaseException:
        # Tell the neighbours, so that nobody waits on us for the process group's timeout.
        # Not waited for: a neighbour that failed too may never receive it.
        for peer in (prev_rank, next_rank):
            if peer is not None:
                # The group itself may be broken: then there is nothing more to do.
                with contextlib.suppress(Exception):
                    send_abort(peer, group=group)
        raise
    return ScheduleResult(losses, live, pool, freed)


def _releaser(sent: dict[int, ReleasedOutput | torch.Tensor], i: int) -> Callable[[], None]:
    def release() -> None:
        out = sent.get(i)
        if isinstance(out, torch.Tensor):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", PipelineWarning)  # a kept output is fine here
                sent[i] = release_output(out)

    return release


def _unreleased_bytes(sent: dict[int, Any]) -> int:
    """Bytes of sent outputs still held: not yet released, or not freeable."""
    total = 0
    for out in sent.values():
        if isinstance(out, torch.Tensor):
            total += out.untyped_storage().nbytes()
        elif isinstance(out, ReleasedOutput):
            total += out.held_bytes
    return total
