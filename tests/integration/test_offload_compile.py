"""OffloadActivations around a model compiled by ``torch.compile`` (the inductor backend on
the CPU, ``force_host_copy=True`` so the hooks' whole path runs)."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

import leakfree


def test_a_compiled_model_offloads_what_its_regions_save() -> None:
    """The hooks see what each compiled region saves for its backward (AOTAutograd's
    choice, after its own recomputation), as the region's forward returns: those tensors
    go to the host and come back, the gradients are plain PyTorch's, and nothing the
    step saved outlives its backward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    compiled = torch.compile(model)
    x = torch.randn(8, 64)
    compiled(x).square().mean().backward()  # compiled once, outside the manager
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    ctx = leakfree.OffloadActivations(force_host_copy=True, min_offload_size=1)
    for _ in range(2):
        before = ctx.stats.to_host
        with ctx:
            out = compiled(x)
            loss = out.square().mean()
        saved = StorageWeakRef(out.untyped_storage())
        loss.backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        assert ctx.stats.to_host > before
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        del out, loss
        assert saved.expired()
