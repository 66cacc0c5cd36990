"""Every ```python block in README.md and docs/*.md runs, so the documentation stays true.

Each block runs in a fresh namespace holding the few names the prose assumes (a model, its
batches, a training step, a Function someone else wrote...), defined below as small real
objects, with a one-process gloo group standing in for the data-parallel group. A block
that cannot run on one CPU process says so in the markdown, on the line before its fence:
``<!-- docs-test: skip (why) -->``. Shell blocks are install and CI commands: the demo
and benchmark commands they name are run by tests/test_cli.py.
"""

from __future__ import annotations

import collections
import queue
import re
import socket
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import leakfree

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(
    r"(?:<!-- docs-test: skip \((?P<why>[^)]*)\) -->\n)?```python\n(?P<code>.*?)```", re.S
)


def _blocks() -> list[Any]:
    params = []
    for path in FILES:
        text = path.read_text()
        for m in _BLOCK.finditer(text):
            line = text[: m.start("code")].count("\n")
            marks = [pytest.mark.skip(reason=m["why"])] if m["why"] else []
            params.append(
                pytest.param(m["code"], id=f"{path.relative_to(ROOT)}:{line}", marks=marks)
            )
    return params


class _Model(nn.Module):
    """A tiny language-model-shaped module: ``model(batch)`` is a scalar loss."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 4)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.relu(self.body(batch))).square().mean()


class _TheirFunction(torch.autograd.Function):
    """A Function someone else wrote, parking state on ctx (Transformer Engine's shape)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.tensor_objects = [torch.zeros(4)]
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 2


def _world() -> dict[str, Any]:
    """The names the documentation's snippets take as given."""
    model = _Model()
    batches = [torch.randn(2, 8) for _ in range(3)]
    context = types.SimpleNamespace(losses=collections.defaultdict(list))

    def train_step(batch: torch.Tensor) -> None:
        model(batch).backward()
        model.zero_grad(set_to_none=True)

    out = collections.namedtuple("Output", "logits aux_loss")(
        model.lm_head(torch.randn(2, 8)), model(batches[0])
    )
    mylib = types.ModuleType("mylib")
    sys.modules.setdefault("mylib", mylib)
    return {
        "torch": torch,
        "pytest": pytest,
        "leakfree": leakfree,
        "model": model,
        "batch": batches[0],
        "batches": batches,
        "microbatches": batches,
        "loss_names": ["lm", "z_loss"],
        "loss": model(batches[0]),
        "train_step": train_step,
        "trainer": types.SimpleNamespace(model=model, context=context),
        "make_big_object": lambda x: torch.zeros(64, 64),
        "TheirFunction": _TheirFunction,
        "dp_group": None,  # the default group (one process here)
        "pp_group": None,
        "metrics_queue": queue.Queue(),
        "out": out,
    }


@pytest.fixture(scope="module")
def one_process_group() -> Iterator[None]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("code", _blocks())
def test_documented_code_runs(code: str, one_process_group: None) -> None:
    """The assertion is the run itself: a block that raises fails (as the old losslog
    snippet did, rebinding the log to one without its second key)."""
    namespace = _world()
    try:
        exec(compile(code, "<docs>", "exec"), namespace)
    finally:
        leakfree.unpatch_all()
        leakfree.remove_offload_hooks(namespace["model"])


def test_every_python_block_is_collected() -> None:
    """The extractor sees every fence (a block it missed would silently go untested)."""
    for path in FILES:
        text = path.read_text()
        assert len(_BLOCK.findall(text)) == text.count("```python"), path
