"""MemoryTracker overhead: a training step with the CPU storage tracker on vs off.

The tracker's dispatch mode sees every aten op of the step, so its cost is per op: a model
of a few large ops pays less than one of many small ones. Both are measured.

    python benchmarks/tracker.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import compare, print_table, write_json

from leakfree.diagnostics import MemoryTracker


def make(width: int, depth: int, batch: int) -> tuple[Any, Any]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*layers, nn.LayerNorm(width))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width)

    def step() -> None:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step, model


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cases = {
        "4 x Linear(1024), batch 256": (1024, 4, 256),
        "8 x Linear(256), batch 64": (256, 8, 64),
    }
    rows, results = [], []
    for name, (width, depth, batch) in cases.items():
        step, _ = make(width, depth, batch)
        tracker = MemoryTracker(devices=[torch.device("cpu")], sample_every=1)

        def tracked(step: Any = step, tracker: MemoryTracker = tracker) -> None:
            with tracker:
                step()
                tracker.step()

        t = compare(
            {"off": step, "on": tracked},
            repeat=5 if args.quick else 21,
            number=3 if args.quick else 10,
        )
        ratio = t["on"] / t["off"]
        rows.append((name, t["off"] / 1e3, t["on"] / 1e3, ratio))
        results.append(
            {"case": name, "off_ms": t["off"] / 1e3, "on_ms": t["on"] / 1e3, "ratio": ratio}
        )
    print_table(
        "training step (forward, backward, SGD step) with the CPU storage tracker",
        ["model", "off ms", "on ms", "ratio"],
        rows,
    )
    payload = {"results": results, "goal": "ratio <= 1.5"}
    write_json("tracker", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
