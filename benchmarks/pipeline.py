"""Non-leaf receive (as_nonleaf + GradSlot + RecvBufferPool) vs the plain leaf receive.

* per-microbatch overhead: receive + a small stage forward/backward + fetch the input
  gradient, leakfree vs `buf.detach().requires_grad_()` and `.grad`;
* live bytes across microbatches when a GPipe-style loop keeps each microbatch's received
  input until the step ends (as schedules keep `input_tensors`): leaf `.grad`s pile up,
  pooled non-leaf buffers do not.

    python benchmarks/pipeline.py [--quick] [--microbatches N] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import compare, print_table, write_json

from leakfree.pipeline import GradSlot, RecvBufferPool, as_nonleaf

SHAPE = (8, 256)


def overhead(repeat: int, number: int) -> dict[str, float]:
    w = torch.randn(SHAPE[1], requires_grad=True)
    incoming = torch.randn(SHAPE)
    grad_out = torch.ones(SHAPE)
    buf = torch.empty(SHAPE)
    pool = RecvBufferPool()

    def leaf() -> torch.Tensor:
        buf.copy_(incoming)  # "receive"
        x = buf.detach().requires_grad_()
        (x * w).backward(grad_out)
        g = x.grad
        assert g is not None
        return g

    def nonleaf() -> torch.Tensor:
        slot = GradSlot()
        buf.copy_(incoming)
        x = as_nonleaf(buf, slot)
        (x * w).backward(grad_out)
        return slot.take()

    def pooled() -> torch.Tensor:
        entry = pool.acquire(SHAPE, torch.float32, "cpu")
        entry.tensor.copy_(incoming)
        x, entry.activation = entry.activation, None
        assert x is not None
        (x * w).backward(grad_out)
        return entry.slot.take()

    return compare(
        {"leaf receive": leaf, "as_nonleaf": nonleaf, "RecvBufferPool": pooled},
        repeat=repeat,
        number=number,
    )


def live_bytes(microbatches: int) -> dict[str, list[int]]:
    w = torch.randn(SHAPE[1], requires_grad=True)
    incoming = torch.randn(SHAPE)
    nbytes = incoming.numel() * incoming.element_size()
    out: dict[str, list[int]] = {"leaf receive": [], "RecvBufferPool": []}
    kept: list[Any] = []
    for _ in range(microbatches):  # the leaf way: a buffer per microbatch, .grad kept
        x = incoming.clone().requires_grad_()
        (x * w).sum().backward()
        kept.append(x)  # schedules keep inputs until the step ends
        out["leaf receive"].append(sum(nbytes * (1 + (t.grad is not None)) for t in kept))
    kept.clear()
    pool = RecvBufferPool()
    for _ in range(microbatches):
        entry = pool.acquire(SHAPE, torch.float32, "cpu")
        entry.tensor.copy_(incoming)
        x, entry.activation = entry.activation, None
        assert x is not None
        (x * w).sum().backward()
        kept.append(entry)  # kept as well, but the buffer went back at delivery
        entry.slot.take()  # sent back upstream
        out["RecvBufferPool"].append(pool.counters.allocated_bytes)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--microbatches", type=int, default=100)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    t = overhead(repeat=7 if args.quick else 31, number=50 if args.quick else 300)
    base = t["leaf receive"]
    print_table(
        f"per microbatch: receive {SHAPE} + x * w forward/backward + input gradient (us)",
        ["receive", "us", "extra us vs leaf"],
        [(k, v, v - base) for k, v in t.items()],
    )
    live = live_bytes(args.microbatches)
    print_table(
        f"bytes held by receive buffers and input gradients, {args.microbatches} microbatches "
        "whose inputs are kept until the step ends",
        ["receive", "after 1", f"after {args.microbatches}"],
        [(k, v[0], v[-1]) for k, v in live.items()],
    )
    payload = {
        "overhead_us": t,
        "extra_us": {k: v - base for k, v in t.items()},
        "goal": "as_nonleaf extra <= 10 us",
        "live_bytes": live,
    }
    write_json("pipeline", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
