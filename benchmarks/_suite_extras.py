"""The GPU suite's parts run only on request: the CUDA Sanitizer (``--sanitizer``), a memory
snapshot read by ``leakfree snapshot`` (``--snapshot``), and with ``--full`` one profiled
step of each leakfree mode (copies each way, both directions at once, copies beside
compute, from the profiler's device timeline) and ``LossLog.reduce``'s host syncs. Every
child process is waited for a bounded time, then killed.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from _suite_device import LEAKFREE_GOALS, Bench, Size, context, under
from _suite_frontier import Run

import leakfree
from leakfree.diagnostics import count_host_syncs

#: the CUDA Sanitizer's model: small enough for its per-kernel bookkeeping
SANITIZED = Size(hidden=256, layers=2, intermediate=512, heads=2, vocab=1024, seq=512)
SANITIZER_WAIT = 120  #: seconds the sanitizer's child may take
SNAPSHOT_WAIT = 60  #: seconds ``leakfree snapshot`` may take


def _child(argv: list[str], wait: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=wait, env=env)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-2000:]
        text = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"exit_status": None, "timed_out": f"killed after {wait} s", "output": text}
    output = (proc.stdout + proc.stderr)[-3000:]
    return {"exit_status": proc.returncode, "output": output}


def sanitizer(bench: Bench, script: str) -> dict[str, Any]:
    """PyTorch's CUDA Sanitizer (``TORCH_CUDA_SANITIZER=1``) over three steps of each
    leakfree goal on a small model, in a child process (it raises on a race)."""
    if bench.device.type != "cuda":
        return {"skipped": "the CUDA Sanitizer needs CUDA"}
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    argv = [sys.executable, script, "--sanitizer-child", "--device", str(bench.device)]
    out = _child(argv, SANITIZER_WAIT, env)
    out["races"] = "CSAN detected" in out["output"]
    return out


def sanitizer_child(bench: Bench) -> None:
    """What the sanitizer's child runs (on a bench of :data:`SANITIZED` size)."""
    ids = bench.ids(bench.size.seq)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = bench.model()
        held = max(bench.step(model, ids, contextlib.nullcontext).held for _ in range(2))
        bench.drop(model)
        for mode in LEAKFREE_GOALS:
            model = bench.model()
            limit = bench.allocated() + held - under(held)
            make = context(mode, model, bench, limit=limit)
            for _ in range(3):
                bench.step(model, ids, make)
            bench.drop(model)
            print(f"{mode}: 3 steps, no race")


def snapshot(bench: Bench, out_dir: Path) -> dict[str, Any]:
    """Two steps of the default recorded by the memory history, written as a snapshot and
    read by ``leakfree snapshot`` (in a child, waited for a bounded time)."""
    if bench.device.type != "cuda":
        return {"skipped": "a memory snapshot needs CUDA"}
    model = bench.model()
    ids = bench.ids(bench.size.seq)
    make = context("default", model, bench)
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        for _ in range(2):
            bench.step(model, ids, make)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
        bench.drop(model)
    path = out_dir / "gpu_suite_snapshot.pickle"
    with path.open("wb") as f:
        pickle.dump(snap, f)
    del snap
    out = _child([sys.executable, "-m", "leakfree", "snapshot", str(path)], SNAPSHOT_WAIT)
    out["file"] = str(path)
    return out


def profile(bench: Bench, ids: torch.Tensor) -> Any:
    """A profiler of one step of a frontier run (CUDA only): the copies each way, how
    long both directions ran at once and how long copies ran beside compute."""

    def measure(model: Any, run: Run) -> dict[str, Any]:
        if bench.device.type != "cuda" or run.context is None:
            return {"skipped": "the profiler's copy timeline needs CUDA"}
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            bench.step(model, ids, run.context)
        return _timeline(prof.events())

    return measure


def _timeline(events: Any) -> dict[str, Any]:
    spans: dict[str, list[tuple[float, float]]] = {"to_host": [], "to_device": [], "compute": []}
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CUDA:  # type: ignore[attr-defined]
            continue
        span = (event.time_range.start, event.time_range.end)
        if "Memcpy DtoH" in event.name:
            spans["to_host"].append(span)
        elif "Memcpy HtoD" in event.name:
            spans["to_device"].append(span)
        elif "Memcpy" not in event.name and "Memset" not in event.name:
            spans["compute"].append(span)
    union = {k: _union(v) for k, v in spans.items()}
    copies = _union(spans["to_host"] + spans["to_device"])
    ms = 1e-3
    return {
        "copies": {k: len(spans[k]) for k in ("to_host", "to_device")},
        "to_host_ms": _length(union["to_host"]) * ms,
        "to_device_ms": _length(union["to_device"]) * ms,
        "both_directions_ms": _overlap(union["to_host"], union["to_device"]) * ms,
        "copies_beside_compute_ms": _overlap(copies, union["compute"]) * ms,
        "copy_ms": _length(copies) * ms,
    }


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def losslog_syncs(bench: Bench, microbatches: int = 256) -> dict[str, Any]:
    """Host syncs of ``LossLog.reduce`` over ``microbatches`` x 3 keys."""
    device = bench.device
    keys = {"loss": "mean", "aux": "sum", "max_logit": "max"}
    log = leakfree.LossLog(keys, device=device)
    for i in range(microbatches):
        for key in keys:
            log[key].append(torch.full((), float(i), device=device))
    if device.type == "cuda":
        torch.cuda.synchronize()
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                log.reduce()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        how = "torch.cuda.set_sync_debug_mode"
    else:
        with count_host_syncs() as counter:
            log.reduce()
        syncs, how = counter.count, "leakfree.diagnostics.count_host_syncs"
    return {
        "microbatches": microbatches,
        "keys": len(keys),
        "reduce_syncs": syncs,
        "item_per_value_syncs": microbatches * len(keys),
        "measured_by": how,
    }
