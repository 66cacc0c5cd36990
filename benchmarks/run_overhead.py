"""What ``python -m leakfree run`` costs a training script, against the same script plain.

The script (written to a temporary folder) trains a random ``LlamaForCausalLM`` built from
a config on CPU: two microbatches of forward with labels and backward, then AdamW and
``zero_grad``, per step. It times its own steps and prints the mean step time over the
steps after its first ``--skip`` (the watch's one-off costs, such as the gc probe after
its warm-up, fall there; the process's total time is reported too). Each round runs the
script plain and under ``leakfree run`` in its default mode (storages tracked on one step
in 8, creation sites, a sample after every backward), in alternating order; the ratio is
taken round by round.

    python benchmarks/run_overhead.py [--quick] [--rounds N] [--steps N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Spread, print_table, write_json

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, os, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.set_num_threads(1)
torch.manual_seed(0)
hidden, steps, skip = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
config = LlamaConfig(
    vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)
model = LlamaForCausalLM(config)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 512, (2, 32))
times = []
for step in range(steps):
    start = time.perf_counter()
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss / 2
        loss.backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - start)
print(json.dumps({"mean_ms": 1e3 * sum(times[skip:]) / len(times[skip:])}))
"""


def one(script: Path, watched: bool, hidden: int, steps: int, skip: int) -> dict[str, float]:
    command = [sys.executable, str(script), str(hidden), str(steps), str(skip)]
    if watched:
        command = [sys.executable, "-m", "leakfree", "run", *command[1:]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    result["found"] = float("leak(s) found" in done.stderr)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 8)
    steps = args.steps or (24 if args.quick else 120)
    skip = 8
    rows, results = [], []
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "train_llama.py"
        script.write_text(SCRIPT)
        for hidden in (64, 128):
            plain: list[dict[str, float]] = []
            watched: list[dict[str, float]] = []
            for r in range(rounds):
                order = (False, True) if r % 2 == 0 else (True, False)
                for w in order:
                    (watched if w else plain).append(one(script, w, hidden, steps, skip))
            ratios = [w["mean_ms"] / p["mean_ms"] for w, p in zip(watched, plain)]
            walls = [w["wall_s"] / p["wall_s"] for w, p in zip(watched, plain)]
            spread, wall_spread = Spread.of(ratios), Spread.of(walls)
            plain_ms = Spread.of([p["mean_ms"] for p in plain]).median
            watched_ms = Spread.of([w["mean_ms"] for w in watched]).median
            name = f"hidden {hidden}, 2 layers, 2 x (batch 2 x seq 32)"
            rows.append((name, plain_ms, watched_ms, str(spread), str(wall_spread)))
            results.append(
                {
                    "case": name,
                    "plain_ms_per_step": plain_ms,
                    "run_ms_per_step": watched_ms,
                    "ratio": spread.as_dict(),
                    "process_wall_ratio": wall_spread.as_dict(),
                    "findings": sum(w["found"] for w in watched),
                }
            )
    print_table(
        f"a training script plain vs under `python -m leakfree run` (default mode), CPU, "
        f"1 thread, mean step time over steps {skip + 1}-{steps}, {rounds} alternating rounds",
        ["model", "plain ms/step", "run ms/step", "ratio median (IQR)", "process wall ratio"],
        rows,
    )
    payload = {
        "results": results,
        "goal": "ratio <= 1.3 ([3/6]); no leak found in this clean script",
        "steps": steps,
        "skip": skip,
        "rounds": rounds,
    }
    write_json("run_overhead", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
