"""Point-to-point sends and receives between stages, over ``torch.distributed``.

Each tensor is preceded by a small header (dtype code, shape), so a receiver allocates the
right buffer and a declared ``shape`` / ``dtype`` that differs from what was sent is an
error naming both. A header with the abort code tells the receiver that its peer failed
(:func:`send_abort`): it raises :class:`PipelineAborted` instead of waiting. Sends in
flight (``isend``) are recorded in a :class:`PendingSends`.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

import leakfree._args as _args
from leakfree.pipeline.buffers import RecvBuffer, RecvBufferPool
from leakfree.pipeline.release import _increment_version

if TYPE_CHECKING:
    from torch.distributed import Work

__all__ = [
    "PendingSends",
    "PipelineAborted",
    "PipelineTimeout",
    "recv_backward",
    "recv_forward",
    "send_abort",
    "send_backward",
    "send_forward",
]


class PipelineAborted(RuntimeError):
    """A peer stage failed: it told this stage so instead of leaving it waiting."""


class PipelineTimeout(TimeoutError):
    """A receive or a send did not complete within the schedule's ``timeout``."""


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


#: every abort sent, with its header and the sends in flight before it, until the process
#: ends: gloo cancels a send whose work is dropped before it left, so an abort nobody waits
#: for (or a send queued before it) would never arrive
_ABORTS: list[tuple[Any, torch.Tensor, PendingSends | None]] = []


def send_abort(dst: int, *, group: Any = None, pending: PendingSends | None = None) -> Any:
    """Tell stage ``dst`` that this stage failed: its next receive from us raises
    :class:`PipelineAborted` instead of waiting. Returns the ``isend`` work.

    Nobody needs to wait for it (the peer may have failed too and never receive it): this
    module keeps the work and its 80-byte header until the process ends, and ``pending``,
    this stage's sends still in flight, with it. A peer receives in order, so those must
    go out first; dropped with a failing schedule's frame, gloo would cancel them, and the
    peer would wait for them until its timeout instead of reading the abort."""
    import torch.distributed as dist

    _args.count("send_abort", "dst", dst, 0, unit="a rank")
    if pending is not None and not isinstance(pending, PendingSends):
        raise _args.refuse("send_abort", "pending", pending, "None or a PendingSends")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0] = _ABORT
    work = dist.isend(header, dst, group=group)
    _ABORTS.append((work, header, pending))
    return work


class _Send:
    """One send in flight: its work, the tensor it reads from, what to run once it is done.

    Both ``work`` (the backend keeps the tensor with it) and ``payload`` hold the sent
    storage, so the record is dropped before ``then`` runs (:meth:`PendingSends._finish`).
    """

    __slots__ = ("payload", "then", "work")

    def __init__(self, work: Work, payload: torch.Tensor, then: Callable[[], None] | None) -> None:
        self.work = work
        self.payload = payload
        self.then = then


class PendingSends:
    """Sends in flight (``isend``) and what to run once each completes.

    ``add(work, keep, then)`` records a send: ``work`` is what ``isend`` returned, ``keep``
    the tensor it reads from (a header, or a contiguous alias of the sent data), ``then``
    an optional callback. ``poll()`` finishes every send that has completed, ``wait_all()``
    waits for all of them (``PipelineTimeout`` after ``timeout`` seconds); both finish
    sends in the order they were added, and look at each record once (O(n)).

    Kept: each ``work``, ``keep`` and ``then``, by this object, until the send is finished
    by ``poll()`` or ``wait_all()``. Then the record, with its ``work`` and ``keep``, is
    dropped *before* ``then`` runs, so that ``release_output`` in ``then`` does not see it
    as another holder of the sent storage and refuse. Sends never finished keep their
    tensors until this object is dropped, and their ``then`` never runs: call
    ``wait_all()`` before dropping it.
    """

    __slots__ = ("_sends",)

    def __init__(self) -> None:
        self._sends: list[_Send] = []

    def __len__(self) -> int:
        """The number of sends recorded and not finished yet."""
        return len(self._sends)

    def add(self, work: Work, keep: torch.Tensor, then: Callable[[], None] | None = None) -> None:
        """Record a send in flight: keep ``keep`` until it completes, then run ``then``."""
        self._sends.append(_Send(work, keep, then))

    def poll(self) -> None:
        """Finish the sends that have completed."""
        completed = [send.work.is_completed() for send in self._sends]
        done = [send for send, c in zip(self._sends, completed) if c]
        self._sends = [send for send, c in zip(self._sends, completed) if not c]
        self._finish(done, None)  # empties `done`: no list here keeps a finished record

    def wait_all(self, timeout: float | None = None) -> None:
        """Wait for every recorded send, finishing each in turn."""
        sends, self._sends = self._sends, []
        self._finish(sends, timeout)

    @staticmethod
    def _finish(sends: list[_Send], timeout: float | None) -> None:
        """Finish ``sends`` in order, emptying the list (the caller keeps no other)."""
        sends.reverse()
        while sends:
            send = sends.pop()  # from here on, the only reference to the record
            _wait(send.work, timeout, "a send")
            then = send.then
            del send  # its work and payload hold the sent storage: they go first
            if then is not None:
                then()


def _sending(
    call: str,
    name: str,
    t: object,
    dst: object,
    pending: object,
    then: object = None,
) -> None:
    """A send's arguments, checked before anything is sent."""
    if not isinstance(t, torch.Tensor):
        raise _args.refuse(call, name, t, "a tensor")
    _args.count(call, "dst", dst, 0, unit="a rank")
    if pending is not None and not isinstance(pending, PendingSends):
        raise _args.refuse(call, "pending", pending, "None or a PendingSends")
    _args.function(call, "then", then, none=True)


def _receiving(
    call: str, src: object, shape: object, dtype: object, device: object, timeout: object
) -> torch.device:
    """A receive's arguments, checked before anything is received; its device."""
    _args.count(call, "src", src, 0, unit="a rank")
    if shape is not None:
        _args.items(call, "shape", shape, (int,), "ints")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise _args.refuse(call, "dtype", dtype, "None or a torch.dtype")
    _args.seconds(call, "timeout", timeout, none=True)
    return _args.device(call, "device", device)


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
    pending: PendingSends | None,
    then: Callable[[], None] | None = None,
) -> None:
    import torch.distributed as dist

    payload = t.detach().contiguous()
    header = _header(payload)
    if pending is None:
        dist.send(header, dst, group=group)
        dist.send(payload, dst, group=group)
        del payload  # not a holder of the storage any more (see PendingSends)
        if then is not None:
            then()
    else:
        pending.add(_isend(header, dst, group), header)
        pending.add(_isend(payload, dst, group), payload, then)


def _isend(t: torch.Tensor, dst: int, group: Any) -> Work:
    import torch.distributed as dist

    work = dist.isend(t, dst, group=group)
    if work is None:  # torch warned: this rank is not in the group, nothing was sent
        raise RuntimeError(
            f"pipeline p2p: isend to rank {dst} sent nothing, this rank is not in "
            f"group={group!r}; pass a group that holds both stages"
        )
    return work


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
    pending: PendingSends | None = None,
    then: Callable[[], None] | None = None,
) -> None:
    """Send a stage's output to stage ``dst`` (a header with shape and dtype, then data).

    Blocking by default; with ``pending`` (a :class:`PendingSends`, as the schedule in
    ``examples/pipeline_two_stages.py`` uses) the sends are ``isend``, ``pending``
    keeps the header and a contiguous alias of the data until they have left, and
    ``then`` runs once they have (e.g. to release the output). Blocking, ``then`` runs
    before this returns.
    """
    _sending("send_forward", "activation", activation, dst, pending, then)
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
    dev = _receiving("recv_forward", src, shape, dtype, device, timeout)
    if pool is not None and not isinstance(pool, RecvBufferPool):
        raise _args.refuse("recv_forward", "pool", pool, "None or a RecvBufferPool")
    _args.function("recv_forward", "callback", callback, none=True)
    pool = pool if pool is not None else RecvBufferPool()
    holder: dict[str, RecvBuffer] = {}

    def make(s: tuple[int, ...], d: torch.dtype) -> torch.Tensor:
        entry = pool.acquire(s, d, dev, callback=callback)
        holder["entry"] = entry
        return entry.tensor

    _recv_into(src, group, dev, shape, dtype, "recv_forward", make, timeout)
    return holder["entry"]


def send_backward(
    grad: torch.Tensor, dst: int, *, group: Any = None, pending: PendingSends | None = None
) -> None:
    """Send the gradient of a received activation back to stage ``dst`` (blocking, or
    recorded in ``pending`` like :func:`send_forward`)."""
    _sending("send_backward", "grad", grad, dst, pending)
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
    dev = _receiving("recv_backward", src, shape, dtype, device, timeout)
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
