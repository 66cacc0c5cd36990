"""Two pipeline stages on one machine (gloo on 127.0.0.1), 1F1B, checked against one process.

    python examples/pipeline_two_stages.py [--schedule gpipe|1f1b] [--microbatches 8]

Stage 0 runs the first half of a small MLP and sends activations to stage 1; stage 1
receives them into pooled buffers as non-leaf tensors (leakfree.pipeline.as_nonleaf), runs
the second half and the loss, and sends the input gradient back from a GradSlot. Stage 0
frees each sent output (release_output) and later runs its backward from the gradient it
receives (backward_from). The parameter gradients are then compared bit for bit with the
same model run in one process.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from leakfree import pipeline

D, STAGES = 32, 2


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
    result = pipeline.run_schedule(
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
