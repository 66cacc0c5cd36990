"""Check the corpus without leakfree: run each script under plain Python, count the bytes of
the tensor storages it made that are still alive after every optimizer step, and say whether
they keep growing.

    python tests/integration/corpus/validate.py [--steps 16,40,160] [--json FILE] [NAME ...]

How it counts (independent of leakfree's own tracker, written here from torch's public API):
a ``TorchDispatchMode`` entered before the script runs records every storage an aten op
returns as a ``StorageWeakRef`` (a weak reference to the storage itself, so a storage held
only by C++, an autograd node or a cycle, still counts), and a global optimizer-step hook sums
the live ones after each step. Storages made outside aten ops (``torch.tensor(list)``) are not
seen; no script keeps those. Each script runs in a new interpreter (one intra-op thread), so
nothing is shared between them.

Per run: ``last growth`` is the last step whose live bytes exceeded every earlier sample by
more than 256 B (where a filling store stops filling; for a noisy run, the largest batch so
far); the slope is the least-squares bytes per step over the last half of the run, and over
the steps after the last growth. Verdict: ``grows`` when the run was still setting new
highs in its last 2 steps and the last half rises by more than 64 B a step; ``grew, then
flat`` when it stopped after the warm-up (step 3) and the tail after it does not rise;
``flat`` otherwise. Python's own objects are counted too (``sys.getallocatedblocks()``, for
the tokenizer cache, which holds no tensor).
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
SLOPE_LIMIT = 64.0  # bytes per step: leakfree's default floor, here only a threshold to print
RISE = 256


def _child(script: str, steps: int, out: str) -> None:
    """Run ``script`` with ``steps`` under the storage counter; write the samples to ``out``."""
    import runpy

    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    live: dict[int, tuple[Any, int]] = {}

    class Storages(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            result = func(*args, **(kwargs or {}))
            for t in tree_flatten(result)[0]:
                if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                    storage = t.untyped_storage()
                    ref = StorageWeakRef(storage)
                    if ref.cdata not in live or live[ref.cdata][0].expired():
                        live[ref.cdata] = (ref, storage.nbytes())
            return result

    samples: list[tuple[int, int, int, float, int]] = []
    start = time.perf_counter()

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        for key in [k for k, (ref, _) in live.items() if ref.expired()]:
            del live[key]
        total = sum(n for _, n in live.values())
        elapsed = time.perf_counter() - start
        samples.append((len(samples) + 1, total, len(live), elapsed, sys.getallocatedblocks()))

    register_optimizer_step_post_hook(after_step)
    sys.argv = [script, str(steps)]
    sys.path[0] = os.path.dirname(script)
    with Storages():
        runpy.run_path(script, run_name="__main__")
    wall = time.perf_counter() - start
    Path(out).write_text(json.dumps({"samples": samples, "wall_s": wall}))


def _slope(points: list[tuple[int, int]]) -> float:
    """Least-squares bytes per step of ``(step, bytes)`` points (0 for fewer than 2)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(s for s, _ in points) / n
    my = sum(b for _, b in points) / n
    var = sum((s - mx) ** 2 for s, _ in points)
    return sum((s - mx) * (b - my) for s, b in points) / var if var else 0.0


def summarise(samples: list[list[float]]) -> dict[str, Any]:
    """Growth figures of one run's samples ``(step, bytes, storages, seconds, blocks)``."""
    points = [(int(s[0]), int(s[1])) for s in samples]
    if not points:
        return {"verdict": "no optimizer step", "steps": 0}
    n = len(points)
    half = [p for p in points if p[0] > n / 2]
    last_growth, best = 0, points[0][1]
    for step, value in points:
        if value > best + RISE:
            last_growth = step
        best = max(best, value)
    slope, tail = _slope(half), _slope([p for p in points if p[0] > last_growth])
    if last_growth >= n - 1 and slope > SLOPE_LIMIT:
        verdict = "grows"
    elif last_growth > 3 and tail <= SLOPE_LIMIT:
        verdict = f"grew until step {last_growth}, then flat"
    else:
        verdict = "flat"
    keep = (1, 4, 8, 16, 24, 40, 80, 160, n)
    blocks = [int(s[4]) for s in samples]
    return {
        "steps": n,
        "verdict": verdict,
        "slope_last_half_B": round(slope, 1),
        "slope_after_last_growth_B": round(tail, 1),
        "growth_total_B": points[-1][1] - points[0][1],
        "last_growth_step": last_growth,
        "live_bytes_at": {str(s): b for s, b in points if s in keep},
        "python_blocks_growth": blocks[-1] - blocks[0],
    }


def run(name: str, steps: int) -> dict[str, Any]:
    """One script, one step count, in a new interpreter; its summary and wall times."""
    script = str(HERE / "scripts" / f"{name}.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="corpus-validate-") as cwd:
        out = str(Path(cwd, "samples.json"))
        done = subprocess.run(
            [sys.executable, __file__, "--child", script, str(steps), out],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        if done.returncode != 0:
            return {"name": name, "steps": steps, "error": done.stderr[-2000:]}
        data = json.loads(Path(out).read_text())
    summary = summarise(data["samples"])
    return {"name": name, "asked_steps": steps, **summary, "wall_s": round(data["wall_s"], 2)}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        _child(argv[1], int(argv[2]), argv[3])
        return 0
    sys.path.insert(0, str(ROOT))
    from tests.integration.corpus.manifest import BY_NAME, CASES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="scripts (default: all)")
    p.add_argument("--steps", default="4,16,40,160", help="(each script runs at its own)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    names = args.names or [c.name for c in CASES]
    results = []
    for name in names:
        case = BY_NAME[name]
        for steps in [int(s) for s in args.steps.split(",")]:
            if steps not in case.steps:
                continue
            r = run(name, steps)
            results.append(r)
            if "error" in r:
                print(f"{name:26} {steps:4}  ERROR {r['error'][-300:]}", flush=True)
                continue
            print(
                f"{name:26} {steps:4}  {r['verdict']:31} last half {r['slope_last_half_B']:8.1f} "
                f"B/step  total {r['growth_total_B']:8d} B  python blocks "
                f"{r['python_blocks_growth']:+7d}  {r['wall_s']:5.2f} s",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
