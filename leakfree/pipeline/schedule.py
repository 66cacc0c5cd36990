"""A small schedule runner: the reference wiring of the pipeline primitives.

:func:`run_schedule` runs GPipe or 1F1B over ``torch.distributed`` point-to-point with
the primitives of :mod:`leakfree.pipeline`, and the tests check its gradients bit for bit
against one process. It is a thin, tested reference, not a training framework: for
training, ``torch.distributed.pipelining`` is the path to take first.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from leakfree.pipeline.buffers import RecvBuffer, RecvBufferPool
from leakfree.pipeline.p2p import (
    PendingSends,
    recv_backward,
    recv_forward,
    send_abort,
    send_backward,
    send_forward,
)
from leakfree.pipeline.release import (
    PipelineWarning,
    ReleasedOutput,
    backward_from,
    release_output,
)

__all__ = ["ScheduleResult", "run_schedule"]


@dataclass
class ScheduleResult:
    """What :func:`run_schedule` returns on each stage.

    Kept: the stage's receive buffer pool (``pool``, with its free buffers), by this
    result, until it is dropped; nothing of the step's graphs.
    """

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

    The reference wiring of the primitives, not a training framework: stage
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
    # The ends of the pipeline: read_input is bound exactly on the first stage (where
    # prev_rank is None), compute_loss exactly on the last (where next_rank is None).
    if first:
        if inputs is None:
            raise ValueError("run_schedule: the first stage needs inputs=")
        read_input = inputs
    if last:
        if loss_fn is None:
            raise ValueError("run_schedule: the last stage needs loss_fn=")
        compute_loss = loss_fn
    ranks = list(ranks) if ranks is not None else list(range(num_stages))
    prev_rank = None if first else ranks[stage_id - 1]
    next_rank = None if last else ranks[stage_id + 1]
    dev = torch.device(device)
    pool = RecvBufferPool()
    pending = PendingSends()
    # Each microbatch is in at most one of sent / released / held, until its backward.
    received: dict[int, RecvBuffer] = {}  # its receive buffer (every stage but the first)
    sent: dict[int, torch.Tensor] = {}  # its output, while the send is in flight
    released: dict[int, ReleasedOutput] = {}  # its output, once sent and released
    held: dict[int, torch.Tensor] = {}  # its loss (the last stage)
    losses: list[float] = []
    live: list[int] = []
    freed = 0

    def forward(i: int) -> None:
        if prev_rank is None:
            x = read_input(i)
        else:
            entry = recv_forward(prev_rank, pool=pool, device=dev, group=group, timeout=timeout)
            x = _take_activation(entry)  # the graph holds it from here on
            received[i] = entry
        y = stage(x)
        if next_rank is None:
            held[i] = compute_loss(y, i)
        else:
            sent[i] = y
            # Free the output's memory as soon as its data has left (Megatron's trick).
            then = _releaser(sent, released, i)
            send_forward(y, next_rank, group=group, pending=pending, then=then)
        del x, y
        pending.poll()

    def backward(i: int) -> None:
        nonlocal freed
        if next_rank is None:
            loss = held.pop(i)
            losses.append(float(loss.detach()))
            loss.backward()  # type: ignore[no-untyped-call]
            del loss
        else:
            if i in sent:
                pending.wait_all(timeout)  # its send is still in flight: finish it (and release)
            out = released.pop(i)
            freed += out.freed
            grad = recv_backward(next_rank, device=dev, group=group, timeout=timeout)
            backward_from(out, grad)
        if prev_rank is not None:
            entry = received.pop(i)
            send_backward(entry.slot.take(), prev_rank, group=group, pending=pending)
        pending.poll()
        held_now = _held_bytes([*sent.values(), *held.values()], released.values())
        live.append(pool.counters.allocated_bytes + held_now)

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


def _take_activation(entry: RecvBuffer) -> torch.Tensor:
    """Hand over a received entry's activation: the entry keeps no reference to it."""
    x = entry.activation
    if x is None:
        raise RuntimeError(
            "run_schedule: recv_forward returned a RecvBuffer whose activation is None "
            "(already taken); a fresh entry always carries one"
        )
    entry.activation = None
    return x


def _releaser(
    sent: dict[int, torch.Tensor], released: dict[int, ReleasedOutput], i: int
) -> Callable[[], None]:
    """What runs once microbatch ``i``'s output has left: move it from sent to released."""

    def release() -> None:
        y = sent.pop(i)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PipelineWarning)  # a kept output is fine here
            released[i] = release_output(y)

    return release


def _held_bytes(tensors: Iterable[torch.Tensor], outputs: Iterable[ReleasedOutput]) -> int:
    """Bytes of outputs still held: not yet released (losses included), or not freeable."""
    return sum(t.untyped_storage().nbytes() for t in tensors) + sum(
        out.held_bytes for out in outputs
    )
