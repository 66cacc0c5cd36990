"""What ``python -m leakfree run`` costs a training script, against the same script plain.

The script (written to a temporary folder) trains a random ``LlamaForCausalLM`` built from
a config on CPU: two microbatches of forward with labels and backward, then AdamW and
``zero_grad``, per step. It comes in two forms: clean, and leaky (it keeps every
microbatch's loss with its graph in a list, the shape whose cost used to grow with the
leak: every retained graph walked again at every step). Each is run for 40, 160 and 320
steps, plain and under ``leakfree run`` at its defaults, in alternating order, and the
ratio of the whole process's wall time is taken round by round (imports, the model's
construction and every one-off cost of the watch included); the mean step time over the
steps after the first ``--skip`` is reported beside it.

    python benchmarks/run_overhead.py [--quick] [--rounds N] [--json PATH]
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
leak = sys.argv[4] == "leak"
kept = []
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
        if leak:
            kept.append(loss)  # for the log, with its graph: the leak leakfree run finds
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - start)
print(json.dumps({"mean_ms": 1e3 * sum(times[skip:]) / len(times[skip:])}))
"""


def one(script: Path, watched: bool, steps: int, skip: int, leak: bool) -> dict[str, float]:
    command = [sys.executable, str(script), "64", str(steps), str(skip)]
    command.append("leak" if leak else "clean")
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
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 5)
    lengths = (16, 40) if args.quick else (40, 160, 320)
    skip = 8
    rows, results = [], []
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "train_llama.py"
        script.write_text(SCRIPT)
        for leak in (False, True):
            for steps in lengths:
                plain: list[dict[str, float]] = []
                watched: list[dict[str, float]] = []
                for r in range(rounds):
                    order = (False, True) if r % 2 == 0 else (True, False)
                    for w in order:
                        (watched if w else plain).append(one(script, w, steps, skip, leak))
                walls = [w["wall_s"] / p["wall_s"] for w, p in zip(watched, plain)]
                ratios = [w["mean_ms"] / p["mean_ms"] for w, p in zip(watched, plain)]
                wall_spread, spread = Spread.of(walls), Spread.of(ratios)
                plain_s = Spread.of([p["wall_s"] for p in plain]).median
                watched_s = Spread.of([w["wall_s"] for w in watched]).median
                name = f"{'leaky' if leak else 'clean'}, {steps} steps"
                found = sum(w["found"] for w in watched)
                rows.append(
                    (name, plain_s, watched_s, str(wall_spread), str(spread), f"{found:.0f}")
                )
                results.append(
                    {
                        "case": name,
                        "leak": leak,
                        "steps": steps,
                        "plain_wall_s": plain_s,
                        "run_wall_s": watched_s,
                        "process_wall_ratio": wall_spread.as_dict(),
                        "step_time_ratio": spread.as_dict(),
                        "runs_with_a_finding": found,
                    }
                )
    print_table(
        "a training script plain vs under `python -m leakfree run` (defaults), CPU, 1 thread: "
        f"whole process wall time, and mean step time over steps {skip + 1}-N; "
        f"{rounds} alternating rounds (Llama hidden 64, 2 layers, 2 x (batch 2 x seq 32))",
        [
            "script",
            "plain s",
            "run s",
            "process ratio median (IQR)",
            "step ratio median (IQR)",
            "found",
        ],
        rows,
    )
    payload = {
        "results": results,
        "goal": "process ratio <= 1.3 at 40, 160 and 320 steps, clean and leaky; "
        "the leak found in every leaky run, nothing in the clean ones",
        "skip": skip,
        "rounds": rounds,
    }
    write_json("run_overhead", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
