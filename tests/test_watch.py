"""``leakfree.watch()``: boundaries found by themselves (optimizer steps, backward
passes), the same detector as MemoryTracker's, a handle with report() and stop()."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import leakfree
from leakfree.diagnostics.watch import Watch
from tests.test_finders import model_and_opt, verl_update


def test_steps_are_optimizer_steps_and_microbatches_backward_passes() -> None:
    model, opt = model_and_opt()
    with leakfree.watch(sample_every=1, on_finding=lambda f: None) as w:
        for _ in range(5):
            verl_update(model, opt, micro=4, detach=False)
    assert (w.steps, w.backwards, w.optimizer_steps) == (5, 20, 5)
    [found] = w.findings
    assert found.kind == "microbatch" and found.step == 1
    assert "output_lst[*]['entropy']" in found.message
    assert "1 leak(s) found" in w.report() and not w.active
    data = w.as_dict()
    assert data["findings"][0]["holders"][0]["where"] == "output_lst[*]['entropy']"
    assert data["findings"][0]["holders"][0]["created_at"].endswith("in compute_entropy")


def test_two_optimizers_stepped_together_are_one_step_and_late_ones_are_seen() -> None:
    torch.manual_seed(0)
    body, head = nn.Linear(8, 8), nn.Linear(8, 1)
    w = Watch(sample_every=1, on_finding=lambda f: None).start()
    try:
        opt_body = torch.optim.SGD(body.parameters(), lr=0.01)  # created after the start
        for _ in range(3):
            head(body(torch.randn(4, 8))).square().mean().backward()
            opt_body.step()
            opt_head = torch.optim.Adam(head.parameters())  # a new one every step, even
            opt_head.step()
    finally:
        w.stop()
    assert (w.steps, w.optimizer_steps) == (3, 6)


def test_a_loop_without_an_optimizer_falls_back_to_backward_passes_and_says_so() -> None:
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    kept: list[torch.Tensor] = []
    with Watch(sample_every=1, fallback=4, on_finding=lambda f: None) as w:
        for _ in range(20):
            loss = model(torch.randn(4, 16)).square().mean()
            loss.backward()
            with torch.no_grad():  # SGD by hand
                for p in model.parameters():
                    p -= 0.01 * p.grad  # type: ignore[operator]
                    p.grad = None
            kept.append(loss)
    assert w.per_backward and w.steps == 17  # the 4th backward pass and every one after
    assert "no optimizer step after 4 backward passes" in w.report()
    assert any("kept[*]" in f.message for f in w.findings)


def test_a_finding_warns_by_default_and_stop_is_idempotent() -> None:
    model, opt = model_and_opt()
    w = leakfree.watch(sample_every=1)
    with pytest.warns(leakfree.MemoryGrowthWarning, match="kept per backward pass"):
        for _ in range(2):
            verl_update(model, opt, micro=3, detach=False)
    w.stop()
    w.stop()
    assert not w.active and len(w.findings) == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sample_every": 0}, r"watch\(sample_every=0\): expected an int >= 1"),
        ({"window": 3}, r"watch\(window=3\): expected an int >= 4"),
        ({"fallback": True}, r"watch\(fallback=True\)"),
        ({"device": "nonsense"}, r"watch\(device='nonsense'\): not a device"),
        ({"roots": "model"}, r"watch\(roots='model'\)"),
        ({"on_finding": 3}, r"watch\(on_finding=3\)"),
    ],
)
def test_bad_options_name_the_argument(options: dict[str, Any], message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        Watch(**options)
