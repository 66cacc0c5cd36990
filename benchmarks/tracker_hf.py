"""The detector's cost on a small transformers causal LM on CPU (random weights).

A training step of a tiny ``LlamaForCausalLM`` built from a config (two microbatches of
forward with labels and backward, then AdamW and zero_grad) is timed without a watcher
and under a ``MemoryTracker``: in its default mode (storages tracked during about one step
in 8, the first always; creation sites recorded; a sample after every backward; the
detector judging every step), tracking every step, and every step without sites or
backward samples (what the tracker cost before creation sites). Each variant keeps one
tracker for the whole run, entered around each of its blocks, so one-off costs (the gc
probe after the warm-up) are paid once, as in a training run; each block's first step is
tracked, so sampled variants pay a little more here than over one long run. Rounds are
interleaved; ratios are taken round by round against the untracked block of the round.

The callbacks (Hugging Face, Lightning) run this same engine at the same defaults.

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
    "hidden 64, 2 layers, 2 x (batch 2 x seq 32)": (64, 2, 2, 32),
    "hidden 128, 2 layers, 2 x (batch 4 x seq 64)": (128, 2, 4, 64),
}
MICRO = 2
VARIANTS: dict[str, dict[str, Any]] = {
    "default (1 step in 8, sites)": {},
    "every step, sites": {"sample_every": 1},
    "every step, no sites, no backward samples": {
        "sample_every": 1,
        "sites": False,
        "microbatches": False,
    },
}


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
        for _ in range(MICRO):
            loss = model(input_ids=ids, labels=ids).loss / MICRO
            loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def block(
    step: Callable[[], None], steps: int, tracker: MemoryTracker | None
) -> Callable[[], None]:
    """``steps`` training steps, inside ``tracker`` unless it is None."""

    def plain() -> None:
        for _ in range(steps):
            step()

    def tracked() -> None:
        assert tracker is not None
        with tracker:
            for _ in range(steps):
                step()
                tracker.step()

    return plain if tracker is None else tracked


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = 6 if args.quick else 48
    repeat = 2 if args.quick else 15
    rows, results = [], []
    cases = list(CASES.items())[:1] if args.quick else list(CASES.items())
    for name, shape in cases:
        step = make_step(*shape)
        trackers = {
            key: MemoryTracker(devices=[torch.device("cpu")], warn=False, **options)
            for key, options in VARIANTS.items()
        }
        fns = {"off": block(step, steps, None)}
        fns.update({key: block(step, steps, tracker) for key, tracker in trackers.items()})
        t = compare(fns, repeat=repeat, number=1, warmup=1)
        off_ms = t["off"] / 1e3 / steps
        for key in VARIANTS:
            ratio = t.ratio(key, "off")
            rows.append((name, key, off_ms, t[key] / 1e3 / steps, str(ratio)))
            results.append(
                {
                    "case": name,
                    "variant": key,
                    "options": VARIANTS[key],
                    "off_ms_per_step": off_ms,
                    "on_ms_per_step": t[key] / 1e3 / steps,
                    "ratio": ratio.as_dict(),
                    "off_ms_spread": t.spread("off").as_dict(),
                    "findings": [f.message for f in trackers[key].findings],
                }
            )
    print_table(
        f"training step ({MICRO} microbatches) of a random LlamaForCausalLM on CPU "
        f"({args.threads} thread(s), {steps}-step blocks, {repeat} interleaved rounds): "
        "watched / plain",
        ["model", "MemoryTracker", "plain ms/step", "watched ms/step", "ratio median (IQR)"],
        rows,
    )
    payload = {
        "results": results,
        "goal": "default mode ratio <= 1.3; no findings on this clean loop",
        "steps_per_block": steps,
        "rounds": repeat,
    }
    write_json("tracker_hf", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
