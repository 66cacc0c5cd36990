"""The report at an out-of-memory error (leakfree/diagnostics/oom.py): a watched loop that
keeps one step's activations after another runs into the simulated accelerator's hard cap
(the allocator raises ``torch.OutOfMemoryError`` as CUDA's does); the watch ends with
what grew, who holds it, and the error itself, unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import leakfree
from leakfree.diagnostics.oom import is_out_of_memory
from leakfree.diagnostics.watch import Watch

MiB = 1 << 20


def _train_until_out_of_memory(device: torch.device, kept: list[torch.Tensor]) -> None:
    model = nn.Linear(256, 256).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(1000):
        x = torch.randn(1024, 256, device=device)
        out = model(x).relu()
        kept.append(out.detach())  # the leak: 1 MiB a step, never let go
        out.sum().backward()
        opt.step()
        opt.zero_grad()


def test_out_of_memory_ends_the_watch_with_the_report_so_far(
    sim: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    sim.limit = 20 * MiB
    history: list[torch.Tensor] = []
    raised: list[BaseException] = []
    with (
        pytest.raises(torch.OutOfMemoryError) as caught,
        leakfree.watch(device=sim.device, on_finding=lambda f: None) as w,
    ):
        try:
            _train_until_out_of_memory(sim.device, history)
        except BaseException as e:
            raised.append(e)
            raise
    assert caught.value is raised[0]  # the error itself, re-raised unchanged
    steps = w.optimizer_steps  # the steps done before the one that ran out
    assert 10 < steps < 20 and len(history) in (steps, steps + 1)
    err = capsys.readouterr().err
    oom = w.oom
    assert oom is not None and oom.text in err
    assert oom.step == steps and f"out of memory after {steps} steps on {sim.device}" in err
    assert "what grew: live bytes went from" in err and "(1.0 MiB/step" in err
    # the holder, by its name in the innermost frame with a caller (the kernel that ran
    # out was called by the autograd engine), holding every step's tensor, first
    held = oom.holders[0]
    assert held["where"] == "kept" and held["kind"] == "detached"
    assert held["count"] == len(history) and held["bytes"] == len(history) * MiB
    assert w.as_dict()["out_of_memory"] == oom.as_dict()
    assert w.as_dict()["allocator"][str(sim.device)]["kind"] == "leak"
    history.clear()


def test_another_error_gets_no_report(sim: Any, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="not memory"), leakfree.watch(device=sim.device) as w:
        raise ValueError("not memory")
    assert w.oom is None and "out of memory" not in capsys.readouterr().err
    assert w.as_dict()["out_of_memory"] is None


def test_what_counts_as_out_of_memory() -> None:
    with pytest.raises(RuntimeError) as cpu:
        torch.empty(1 << 62, dtype=torch.uint8)  # the CPU allocator refuses it
    assert is_out_of_memory(cpu.value)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(None)


def test_a_watch_that_is_not_active_makes_no_report() -> None:
    w = Watch()
    assert w.out_of_memory(MemoryError()) is None
