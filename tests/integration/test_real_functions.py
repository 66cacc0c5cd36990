"""release_after_backward on real Functions of installed packages: torch's reentrant
checkpoint and bitsandbytes' 8-bit matmuls. Each test keeps the loss alive after backward
(a logged loss), shows the ctx state alive without leakfree and freed with it, gradients
``torch.equal``, and the original class back after ``restore()``."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointFunction, checkpoint

import leakfree
from tests._fresh import run_python

ROOT = Path(__file__).resolve().parents[2]

#: Builds a model and its step on a fixed seed; the step returns the loss.
Build = Callable[[], tuple[torch.nn.Module, Callable[[], torch.Tensor]]]


def nodes_of(loss: torch.Tensor, cls: type) -> list[Any]:
    kind = cls._backward_cls  # type: ignore[attr-defined]
    found, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node) is kind:
            found.append(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return found


def ctx_refs(nodes: list[Any], attr: Callable[[Any], torch.Tensor]) -> list[StorageWeakRef]:
    return [StorageWeakRef(attr(n).untyped_storage()) for n in nodes]


def step_once(
    build: Build, cls: type, attr: Callable[[Any], torch.Tensor]
) -> tuple[torch.Tensor, list[StorageWeakRef], list[torch.Tensor]]:
    """One training step; returns the loss (kept, as a logger would), weak references to
    the ctx state of ``cls``'s nodes taken before backward, and the gradients."""
    torch.manual_seed(0)
    model, step = build()
    loss = step()
    nodes = nodes_of(loss, cls)
    assert nodes, f"the step does not run {cls.__qualname__}"
    refs = ctx_refs(nodes, attr)
    del nodes
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return loss, refs, grads


def check_release(build: Build, cls: type, attr: Callable[[Any], torch.Tensor]) -> None:
    original = cls.__dict__["backward"]
    loss, refs, plain = step_once(build, cls, attr)
    assert not any(r.expired() for r in refs)  # plain PyTorch: pinned by the kept loss
    del loss
    assert all(r.expired() for r in refs)  # ... and by nothing else

    with leakfree.release_after_backward(cls) as handle:
        loss, refs, released = step_once(build, cls, attr)
        assert all(r.expired() for r in refs)  # freed at backward, the loss still held
        assert loss.grad_fn is not None
    assert not handle.active and cls.__dict__["backward"] is original
    assert len(plain) == len(released) and all(map(torch.equal, plain, released))

    loss, refs, _ = step_once(build, cls, attr)  # restored: plain behaviour again
    assert not any(r.expired() for r in refs)


# --- torch.utils.checkpoint, use_reentrant=True -------------------------------------------


def checkpointed() -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Dropout(0.2))
        for _ in range(3)
    ]
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), *blocks, torch.nn.Linear(16, 1))
    x = torch.randn(4, 8)

    def step() -> torch.Tensor:
        h = model[0](x)
        for block in blocks:
            h = checkpoint(block, h, use_reentrant=True)
        return model[-1](h).pow(2).mean()

    return model, step


def test_checkpoint_function_rng_state_released() -> None:
    # CheckpointFunction keeps the CPU RNG state (5,056 bytes) on ctx for the recompute.
    check_release(checkpointed, CheckpointFunction, lambda n: n.fwd_cpu_state)


# --- bitsandbytes -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def bnb() -> Iterator[Any]:
    bitsandbytes = pytest.importorskip("bitsandbytes")
    yield bitsandbytes


def quantized(layer: Callable[[], torch.nn.Module], train: bool) -> Build:
    def build() -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), layer(), torch.nn.Linear(32, 1))
        model.train(train)
        x = torch.randn(4, 8)
        return model, lambda: model(x).float().pow(2).mean()

    return build


def test_bnb_matmul_8bit_fp_input_released(bnb: Any) -> None:
    # Linear8bitLt in training on CPU runs MatMul8bitFp, which keeps its input as ctx.A.
    from bitsandbytes.autograd._functions import MatMul8bitFp

    build = quantized(lambda: bnb.nn.Linear8bitLt(32, 32, has_fp16_weights=True), train=True)
    check_release(build, MatMul8bitFp, lambda n: n.A)


def test_bnb_matmul_8bit_lt_input_released(bnb: Any) -> None:
    # A frozen int8 layer in eval mode runs MatMul8bitLt: its input sits in ctx.tensors.
    from bitsandbytes.autograd._functions import MatMul8bitLt

    build = quantized(
        lambda: bnb.nn.Linear8bitLt(32, 32, has_fp16_weights=False).to("cpu"), train=False
    )
    check_release(build, MatMul8bitLt, lambda n: n.tensors[2])


def test_patch_functions_sweeps_bitsandbytes_and_undoes(bnb: Any) -> None:
    from bitsandbytes.autograd import _functions as f

    classes = (f.MatMul8bitLt, f.MatMul8bitFp, f.MatMul4Bit)
    originals = [c.__dict__["backward"] for c in classes]
    sweep = leakfree.patch_functions("bitsandbytes")
    try:
        assert set(classes) <= set(sweep.classes)
        assert all(leakfree.released_attributes(c) == "all" for c in classes)
    finally:
        sweep.remove()
    assert [c.__dict__["backward"] for c in classes] == originals
    assert all(leakfree.released_attributes(c) == () for c in classes)


# --- the benchmark behind docs/function.md ----------------------------------------------


def test_real_functions_benchmark_runs(tmp_path: Path, bnb: Any) -> None:
    out = tmp_path / "real_functions.json"
    argv = (
        str(ROOT / "benchmarks" / "real_functions.py"),
        "--steps=2",
        "--no-sweep",
        "--only=CheckpointFunction",
        "--only=MatMul8bitFp",
        f"--json={out}",
    )
    # forked from the torch-preloaded server: the script's code, without torch's import
    status, _, stderr = run_python(*argv, cwd=tmp_path, timeout=300)
    assert status == 0, stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    rows = {r["functions"][0].rsplit(".", 1)[-1]: r for r in results}
    assert set(rows) == {"CheckpointFunction", "MatMul8bitFp"}
    checkpoint_row = rows["CheckpointFunction"]
    assert checkpoint_row["nodes_per_step"] == 4
    assert checkpoint_row["retained_per_step"]["plain"]["per_step"] == [4 * 5056] * 2
    for row in rows.values():
        assert row["same_grads"]
        assert row["retained_per_step"]["plain"]["min"] > 0
        assert row["retained_per_step"]["released"]["per_step"] == [0, 0]
        assert row["growth_per_step"]["released"]["per_step"] == [4, 4]  # the logged loss
