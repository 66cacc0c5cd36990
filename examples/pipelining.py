"""torch.distributed.pipelining with leakfree: stages repaired, losses without graphs, memory
checked per step.

    python examples/pipelining.py [--schedule ScheduleGPipe|Schedule1F1B] [--steps 20]

Two processes (gloo on 127.0.0.1) train a small MLP split in two ``PipelineStage``\\ s with
4 microbatches, after ``leakfree.patch_all()`` (from torch 2.13 it repairs what the stages
keep longer than a microbatch: docs/pipeline.md). The last stage passes
``leakfree.pipeline.PipelineLosses`` as ``schedule.step(..., losses=...)``: after each step
it holds that step's losses, detached, and forwards them to a ``LossLog`` that is reduced
every 5 steps. Every rank wraps its steps in ``leakfree.diagnostics.MemoryTracker`` and
fails if live memory grows.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import leakfree
from leakfree import LossLog
from leakfree.diagnostics import MemoryTracker
from leakfree.pipeline import PipelineLosses

D, MICROBATCHES = 32, 4


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, D, generator=g), torch.randn(16, D, generator=g)


def stage_main(rank: int, port: int, schedule_name: str, steps: int) -> None:
    leakfree.patch_all()  # at startup: torch's pipelining stages repaired (torch >= 2.13)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D), nn.Linear(D, 4 * D), nn.GELU()
    )
    model.append(nn.Linear(4 * D, D))
    part = model[:3] if rank == 0 else model[3:]
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    cls = {"ScheduleGPipe": ScheduleGPipe, "Schedule1F1B": Schedule1F1B}[schedule_name]
    schedule = cls(stage, n_microbatches=MICROBATCHES, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(part.parameters(), lr=0.05)
    log = LossLog(["loss"])
    losses = PipelineLosses(log)  # this step's losses, detached; every step's go to log

    tracker = MemoryTracker(devices=["cpu"], sample_every=1)
    with tracker:
        for step in range(steps):
            x, y = batch(step)
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if rank == 1 and step % 5 == 4:
                mean = log.reduce(groups=())["loss"]  # this rank: 5 steps x 4 microbatches
                print(f"steps {step - 4}-{step}: mean loss {mean:.4f}", flush=True)
            tracker.step()
    growth = tracker.growth(skip=2)
    print(f"rank {rank}: live bytes {tracker.series['cpu'][-1]}, growth {growth}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if growth.exceeds():
        raise SystemExit(f"rank {rank}: memory grows\n{tracker.report(skip=2)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--schedule", default="Schedule1F1B", choices=["ScheduleGPipe", "Schedule1F1B"]
    )
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if args.steps < 5:
        parser.error("--steps: at least 5 (the loss is reported every 5 steps)")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(stage_main, args=(port, args.schedule, args.steps), nprocs=2, join=True)


if __name__ == "__main__":
    main()
