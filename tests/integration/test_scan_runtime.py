"""What `leakfree scan` reports in the installed transformers, checked by running it.

The scanner reads reformer's and I-BERT's Functions as text; here the real classes run on
the CPU and the attributes it names are still on each node after its backward, while what
`save_for_backward` saved is gone. A finding that did not hold a tensor at run time, or a
held tensor the scan does not name, fails.
"""

from __future__ import annotations

import gc
import importlib.util
from pathlib import Path

import pytest
import torch

from leakfree.diagnostics import find_retained
from leakfree.scan import scan

transformers = pytest.importorskip("transformers")
from transformers.models.ibert import quant_modules  # noqa: E402
from transformers.models.reformer import modeling_reformer  # noqa: E402


def _findings(module: object) -> set[str]:
    path = Path(module.__file__)  # type: ignore[attr-defined]
    return {f.symbol for f in scan([str(path)]).findings if f.rule == "LF001"}


def test_reformer_keeps_what_the_scan_names() -> None:
    assert {
        "ReverseSort.sorted_bucket_idx",
        "_ReversibleFunction.all_buckets",
        "_ReversibleFunction.attention_mask",
    } <= _findings(modeling_reformer)

    # the model: the reversible function's ctx keeps every layer's buckets and the mask
    torch.manual_seed(0)
    config = transformers.ReformerConfig(
        attn_layers=["local", "lsh"], hidden_size=32, feed_forward_size=32,
        num_attention_heads=2, attention_head_size=16, axial_pos_embds=False,
        max_position_embeddings=64, vocab_size=50, local_attn_chunk_length=8,
        lsh_attn_chunk_length=8, num_buckets=4, num_hashes=1,
    )  # fmt: skip
    model = transformers.ReformerModel(config).train()
    ids = torch.randint(0, 50, (2, 32))
    loss = model(ids, attention_mask=torch.ones(2, 32, dtype=torch.long)).last_hidden_state.sum()
    loss.backward()
    report = str(find_retained(loss, names=["loss"]))
    assert "_ReversibleFunction.ctx.all_buckets" in report
    assert "_ReversibleFunction.ctx.attention_mask" in report

    # ReverseSort runs inside the reversible layers' recomputation: applied directly
    out_vectors = torch.randn(2, 2, 16, 8, requires_grad=True)
    logits = torch.randn(2, 2, 16, requires_grad=True)
    idx = torch.stack([torch.randperm(16) for _ in range(4)]).view(2, 2, 16)
    out, _ = modeling_reformer.ReverseSort.apply(out_vectors, logits, idx, idx.argsort(-1))
    out.sum().backward()
    assert out.grad_fn.sorted_bucket_idx is idx  # still on the node after its backward


def test_ibert_keeps_what_the_scan_names() -> None:
    assert {"FixedPointMul.identity", "SymmetricQuantFunction.scale"} <= _findings(quant_modules)

    x = torch.randn(4, 8, requires_grad=True)
    scale = torch.full((4,), 0.05)  # per output row, as I-BERT quantizes a weight
    q = quant_modules.SymmetricQuantFunction.apply(x, 8, False, scale)
    q.sum().backward()
    assert q.grad_fn.scale is scale

    pre = torch.randn(4, 8, requires_grad=True)
    identity = torch.randn(4, 8, requires_grad=True)
    factors = (torch.full((1,), 0.1), torch.full((1,), 0.1), torch.full((1,), 0.2))
    y = quant_modules.FixedPointMul.apply(pre, factors[0], 8, factors[2], identity, factors[1])
    y.sum().backward()
    assert y.grad_fn.identity is identity
    del q, y
    gc.collect()


def test_transformers_scans_clean_but_for_these_real_leaks() -> None:
    # precision on the whole installed package: nothing else is reported as a leak
    root = Path(importlib.util.find_spec("transformers").origin).parent  # type: ignore[union-attr, arg-type]
    found = {
        (Path(f.path).name, f.symbol) for f in scan([str(root)]).findings if f.level == "warning"
    }
    assert found == {
        ("quant_modules.py", "FixedPointMul.identity"),
        ("quant_modules.py", "SymmetricQuantFunction.scale"),
        ("modeling_reformer.py", "ReverseSort.sorted_bucket_idx"),
        ("modeling_reformer.py", "_ReversibleFunction.all_buckets"),
        ("modeling_reformer.py", "_ReversibleFunction.attention_mask"),
    }
