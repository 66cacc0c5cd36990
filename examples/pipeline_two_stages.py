"""Hand-written pipeline stages with leakfree's primitives: GPipe / 1F1B, checked against
one process.

    python examples/pipeline_two_stages.py [--schedule gpipe|1f1b] [--microbatches 8]

For training, use ``torch.distributed.pipelining`` (see examples/pipelining.py and
docs/pipeline.md). This file is for people who write their own send / receive: it wires
leakfree.pipeline's primitives into a small schedule runner (:func:`run_schedule`, a
reference, not a library API). Stage 0 runs the first half of a small MLP and sends
activations to stage 1; stage 1 receives them into pooled buffers as non-leaf tensors
(as_nonleaf), runs the second half and the loss, and sends the input gradient back from a
GradSlot. Stage 0 frees each sent output (release_output) once its isend completed and
later runs its backward from the gradient it receives (backward_from). A stage that fails
sends an abort to its neighbours (send_abort), so they raise PipelineAborted at once;
``timeout=`` bounds every wait (PipelineTimeout). Two processes (gloo on 127.0.0.1); the
parameter gradients are compared bit for bit with the same model run in one process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import tempfile
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from leakfree.pipeline import (
    PipelineWarning,
    RecvBufferPool,
    backward_from,
    recv_backward,
    recv_forward,
    release_output,
    send_abort,
    send_backward,
    send_forward,
)
from leakfree.pipeline.buffers import RecvBuffer
from leakfree.pipeline.p2p import PendingSends
from leakfree.pipeline.release import ReleasedOutput

D, STAGES = 32, 2


@dataclass
class ScheduleResult:
    """What :func:`run_schedule` returns on each stage: the losses, the live bytes after
    each microbatch's backward and the receive buffer pool (nothing of the graphs)."""

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

    A reference wiring of the primitives, not a training framework: stage
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
    # One pool per call: a training loop would create it once and pass it in.
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
        # Not waited for: a neighbour that failed too may never receive it. send_abort
        # keeps the sends still in flight, which the neighbour reads first.
        for peer in (prev_rank, next_rank):
            if peer is not None:
                # The group itself may be broken: then there is nothing more to do.
                with contextlib.suppress(Exception):
                    send_abort(peer, group=group, pending=pending)
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


# --- the demo ---------------------------------------------------------------------------


def build() -> list[nn.Sequential]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(D, D), nn.GELU()]
    half = len(layers) // STAGES
    return [nn.Sequential(*layers[i * half : (i + 1) * half]) for i in range(STAGES)]


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)


def loss_fn(y: torch.Tensor, i: int) -> torch.Tensor:
    return nn.functional.mse_loss(y, batch(i)[1])


def stage_main(rank: int, port: int, out: str, schedule: str, m: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=STAGES
    )
    stage = build()[rank]
    result = run_schedule(
        stage,
        stage_id=rank,
        num_stages=STAGES,
        num_microbatches=m,
        inputs=lambda i: batch(i)[0],
        loss_fn=loss_fn,
        schedule=schedule,
    )
    torch.save(
        {
            "grads": [p.grad for p in stage.parameters()],
            "losses": result.losses,
            "buffers": result.pool.counters.allocated,
        },
        Path(out) / f"stage{rank}.pt",
    )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            stage_main, args=(port, tmp, args.schedule, args.microbatches), nprocs=STAGES, join=True
        )
        results = [torch.load(Path(tmp) / f"stage{r}.pt") for r in range(STAGES)]

    stages = build()
    model = nn.Sequential(*stages)
    for i in range(args.microbatches):
        loss_fn(model(batch(i)[0]), i).backward()
    same = all(
        torch.equal(a, p.grad)
        for r, s in enumerate(stages)
        for a, p in zip(results[r]["grads"], s.parameters())
    )
    print(f"{args.schedule}, {args.microbatches} microbatches over {STAGES} stages")
    print("losses:", " ".join(f"{x:.4f}" for x in results[-1]["losses"]))
    print(f"receive buffers allocated on stage 1: {results[1]['buffers']}")
    print(f"gradients bit-identical to one process: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
