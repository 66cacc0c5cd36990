"""The demo behind ``python -m leakfree demo``: each leak shape, naive vs leakfree.

Each shape is a tiny training loop run twice, once written the usual way and once with the
leakfree primitive. Retained bytes are measured by following tensor *storages* with weak
references (they see what C++ autograd nodes still hold), so the numbers are the same on a
CPU-only machine as on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

import leakfree


@dataclass
class ShapeResult:
    shape: str
    naive_bytes: list[int]
    leakfree_bytes: list[int]


class StorageWatch:
    """Bytes of watched storages that are still alive."""

    def __init__(self) -> None:
        self._refs: list[tuple[StorageWeakRef, int]] = []

    def watch(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        self._refs.append((StorageWeakRef(storage), storage.nbytes()))  # type: ignore[no-untyped-call]

    def live_bytes(self) -> int:
        self._refs = [(r, n) for r, n in self._refs if not r.expired()]  # type: ignore[no-untyped-call]
        return sum(n for _, n in self._refs)


def _ctx_attribute_shape(base: type, steps: int, device: torch.device) -> list[int]:
    """A Function parks a 1 MiB side buffer on ctx; the loop keeps each step's loss."""
    watch = StorageWatch()

    class Project(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x, w)
            ctx.workspace = torch.empty(256 * 1024, device=x.device)  # 1 MiB, like TE's buffers
            watch.watch(ctx.workspace)
            return x @ w

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x, w = ctx.saved_tensors
            return g @ w.T, x.T @ g

    w = torch.randn(64, 64, device=device, requires_grad=True)
    kept = []
    series = []
    for _ in range(steps):
        x = torch.randn(32, 64, device=device)
        loss = Project.apply(x, w).square().mean()
        loss.backward()
        kept.append(loss)  # "for logging": the loss still carries its graph
        series.append(watch.live_bytes())
    return series


SHAPES: dict[str, Callable[[type, int, torch.device], list[int]]] = {
    "ctx attribute (TE ctx.tensor_objects)": _ctx_attribute_shape,
}


def _device() -> torch.device:
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        if acc is not None:
            return acc
    return torch.device("cpu")


def run_demo(steps: int = 20) -> int:
    device = _device()
    print(f"leakfree {leakfree.__version__} demo on {device} (torch {torch.__version__})\n")
    results = []
    for name, shape in SHAPES.items():
        naive = shape(torch.autograd.Function, steps, device)
        fixed = shape(leakfree.Function, steps, device)
        results.append(ShapeResult(name, naive, fixed))
    header = f"{'leak shape':<40} {'naive retained':>16} {'leakfree retained':>18}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.shape:<40} {_mib(r.naive_bytes[-1]):>16} {_mib(r.leakfree_bytes[-1]):>18}")
    print(f"\nbytes still held after {steps} steps (each step keeps its loss for logging)")
    return 0


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
