"""MemoryTracker overhead on a small transformers causal LM (random weights, CPU).

A training step (forward with labels, backward, AdamW step, zero_grad) of a tiny
``LlamaForCausalLM`` built from a config, timed without a tracker and with a CPU
``MemoryTracker`` (storages counted by its dispatch mode) tracking every step
(``sample_every=1``: what every version before 0.x did) or one step in ``k``. Rounds are
interleaved; each round runs a block of steps per variant (a fresh ``with tracker:`` block:
its first step is always tracked, so sampled variants pay slightly more here than over one
long run). Ratios are taken round by round against the untracked block of the same round.

    python benchmarks/tracker_hf.py [--quick] [--threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import compare, print_table, write_json

from leakfree.diagnostics import MemoryTracker

CASES = {
    "hidden 64, 2 layers, batch 2 x seq 32": (64, 2, 2, 32),
    "hidden 128, 2 layers, batch 4 x seq 64": (128, 2, 4, 64),
}
SAMPLING = (1, 4, 8)


def make_step(hidden: int, layers: int, batch: int, seq: int) -> Callable[[], None]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * seq,
    )
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (batch, seq))

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def block(step: Callable[[], None], steps: int, every: int | None) -> Callable[[], None]:
    """``steps`` training steps, under a fresh tracker unless ``every`` is None."""

    def plain() -> None:
        for _ in range(steps):
            step()

    def tracked() -> None:
        tracker = MemoryTracker(devices=[torch.device("cpu")], sample_every=every or 1)
        with tracker:
            for _ in range(steps):
                step()
                tracker.step()

    return plain if every is None else tracked


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = 8 if args.quick else 24
    repeat = 3 if args.quick else 15
    rows, results = [], []
    for name, shape in CASES.items():
        step = make_step(*shape)
        fns = {"off": block(step, steps, None)}
        fns.update({f"every {k}": block(step, steps, k) for k in SAMPLING})
        t = compare(fns, repeat=repeat, number=1, warmup=1)
        off_ms = t["off"] / 1e3 / steps
        for k in SAMPLING:
            key = f"every {k}"
            ratio = t.ratio(key, "off")
            rows.append((name, key, off_ms, t[key] / 1e3 / steps, str(ratio)))
            results.append(
                {
                    "case": name,
                    "sample_every": k,
                    "off_ms_per_step": off_ms,
                    "on_ms_per_step": t[key] / 1e3 / steps,
                    "ratio": ratio.as_dict(),
                    "off_ms_spread": t.spread("off").as_dict(),
                }
            )
    print_table(
        f"training step of a random LlamaForCausalLM on CPU ({args.threads} thread(s), "
        f"{steps}-step blocks, {repeat} interleaved rounds): tracked / untracked",
        ["model", "tracked steps", "off ms/step", "on ms/step", "ratio median (IQR)"],
        rows,
    )
    payload = {
        "results": results,
        "goal": "ratio <= 1.5 (sample_every=8, the tracker's cost on a long run is lower still)",
        "steps_per_block": steps,
        "rounds": repeat,
    }
    write_json("tracker_hf", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
