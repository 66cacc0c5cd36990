"""What can I train under this much memory, and how fast? The H100 run's Llama (hidden 2048,
8 layers, intermediate 5440, bf16), dry on the simulated device, timed by the H100 model.

Under a cap on what the device holds (as ``torch.cuda.set_per_process_memory_fraction``
sets one: on reserved bytes, parameters and gradients included), for each way of saving
memory: the longest sequence (in steps of 512 tokens, at batch 2) and the largest batch
(at 4096 tokens) that train a step without running out of memory, and the step time per
token there. The caps: what no offloading holds at batch 2 x 4096, and three quarters
and half of it. Every number is predicted (``tests/simdev/fit.py`` says how); on a GPU,
``benchmarks/gpu_suite.py`` measures the same under ``set_per_process_memory_fraction``.

    python benchmarks/offload_fit.py [--quick] [--json PATH]

``--quick``: the first cap only, lengths in steps of 1024 (about 2 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.simdev import fit
from tests.simdev import predict as h100

GiB = 1 << 30


def run(*, quick: bool, layers: int = 8, modes: tuple[str, ...] = fit.MODES) -> dict[str, Any]:
    """The fit table (see the module doc), as rows and their winners."""
    with h100.dry_device() as sim, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        caps = fit.caps(sim, layers=layers)
        caps = caps[:1] if quick else caps
        rows = []
        for cap in caps:
            for mode in modes:
                started = time.perf_counter()
                got = fit.fit(sim, mode, cap, step=1024 if quick else 512, layers=layers)
                rows.append(
                    {
                        "cap_gib": cap / GiB,
                        "mode": mode,
                        "longest_seq": got.longest,
                        "longest_us_per_token": _us(got.longest_per_token),
                        "largest_batch": got.largest_batch,
                        "batch_us_per_token": _us(got.batch_per_token),
                        "seconds": time.perf_counter() - started,
                    }
                )
    return {"rows": rows, "winners": _winners(rows), "predicted": True}


def _us(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e6


def _winners(rows: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Per cap: the mode that trains the longest sequence (the faster among equals) and
    the one that trains batch 2 x 4096 fastest, if any does."""
    out: dict[str, dict[str, str]] = {}
    for cap in sorted({r["cap_gib"] for r in rows}, reverse=True):
        here = [r for r in rows if r["cap_gib"] == cap]
        longest = max(here, key=lambda r: (r["longest_seq"], -(r["longest_us_per_token"] or 0)))
        fast = [r for r in here if r["largest_batch"] >= 2 and r["batch_us_per_token"]]
        fastest = min(fast, key=lambda r: r["batch_us_per_token"]) if fast else None
        out[f"{cap:.2f} GiB"] = {
            "longest": longest["mode"],
            "fastest at 2 x 4096": fastest["mode"] if fastest else "none trains it",
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one cap, steps of 1024 tokens")
    parser.add_argument("--json", default=None, help="where to write the JSON result")
    args = parser.parse_args(argv)
    if not h100._device.supported():
        print("not run: the simulated device does not support this torch")
        return {}
    result = run(quick=args.quick)
    print_table(
        "What trains under a cap on what the device holds (H100 model, predicted): the "
        "longest sequence at batch 2, the largest batch at 4096, and the time per token",
        ["cap GiB", "mode", "longest seq", "us/token", "largest batch", "us/token"],
        [
            [
                f"{r['cap_gib']:.2f}",
                r["mode"],
                r["longest_seq"],
                _fmt(r["longest_us_per_token"]),
                r["largest_batch"],
                _fmt(r["batch_us_per_token"]),
            ]
            for r in result["rows"]
        ],
    )
    for cap, won in result["winners"].items():
        fastest = won["fastest at 2 x 4096"]
        print(f"{cap}: longest: {won['longest']}; fastest at 2 x 4096: {fastest}")
    write_json("offload_fit", result, args.json)
    return result


def _fmt(us: float | None) -> str:
    return "-" if us is None else f"{us:.1f}"


if __name__ == "__main__":
    main()
