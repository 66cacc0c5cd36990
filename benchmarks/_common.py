"""Shared helpers for the benchmark scripts: timing, tables, JSON output."""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from leakfree._text import format_table

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Spread:
    """Median and spread of repeated samples (of a time or of a ratio)."""

    median: float
    q1: float
    q3: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
        return cls(statistics.median(values), q1, q3, min(values), max(values))

    def as_dict(self) -> dict[str, float]:
        return {
            "median": self.median,
            "q1": self.q1,
            "q3": self.q3,
            "min": self.low,
            "max": self.high,
        }

    def __str__(self) -> str:
        return f"{self.median:.3f} (IQR {self.q1:.3f}-{self.q3:.3f})"


class Timings(dict[str, float]):
    """Median microseconds per call of each function, with every sample kept.

    Samples are taken round-robin, so sample ``i`` of every function comes from the same
    stretch of time: :meth:`ratio` divides them round by round, which cancels most of the
    noise a shared machine adds.
    """

    def __init__(self, samples: dict[str, list[float]]) -> None:
        super().__init__({k: statistics.median(v) for k, v in samples.items()})
        self.samples = samples

    def ratio(self, num: str, den: str) -> Spread:
        return Spread.of([a / b for a, b in zip(self.samples[num], self.samples[den])])

    def spread(self, name: str) -> Spread:
        return Spread.of(self.samples[name])


def compare(
    fns: dict[str, Callable[[], Any]], *, repeat: int, number: int, warmup: int = 5
) -> Timings:
    """Time each function ``number`` calls at a time, ``repeat`` rounds, interleaved.

    Each round runs the functions in a new order (shuffled, seeded: the same orders every
    run), so none always runs right after the same one: a sample may include some of the
    previous function's deferred work (frees, garbage collections, a cold cache), which a
    fixed order would charge to the same function every round (about 1% on the simulated
    tiny Llama of offload.py, measured by swapping two modes)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    items = list(fns.items())
    order = random.Random(0)
    for _ in range(repeat):
        order.shuffle(items)
        for name, fn in items:
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            samples[name].append((time.perf_counter() - t0) / number * 1e6)
    return Timings(samples)


class StorageWatch:
    """Bytes of the watched tensors' storages that are still alive (weak references)."""

    def __init__(self) -> None:
        self._refs: list[tuple[StorageWeakRef, int]] = []

    def watch(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        self._refs.append((StorageWeakRef(storage), storage.nbytes()))

    def live_bytes(self) -> int:
        self._refs = [(r, n) for r, n in self._refs if not r.expired()]
        return sum(n for _, n in self._refs)


def environment() -> dict[str, Any]:
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "accelerator": str(acc) if acc is not None else None,
    }


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[_fmt(c) for c in r] for r in rows]
    print(f"\n{title}")
    print(format_table([str(h) for h in header], cells, right=range(len(header)), markdown=True))


def _fmt(c: Any) -> str:
    if isinstance(c, float):
        return f"{c:.3f}" if abs(c) < 100 else f"{c:.1f}"
    return str(c)


def write_json(name: str, payload: dict[str, Any], out: str | None = None) -> Path:
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "environment": environment(), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {path}")
    return path
