"""find_retained on the shapes where it misreported on real models: a tiny random Llama from
``transformers`` (CPU, no downloads), and bitsandbytes 4-bit layers with trainable low-rank
adapters beside them (the QLoRA shape) run forward and backward on the CPU. (peft's LoRA
dispatch refuses to import next to the torchao that torchtune 0.6 needs, so the adapter is
written out here: two ``nn.Linear`` beside the frozen 4-bit layer, as peft builds it.)

Each test first proves the shape with weak references (what is alive, and that it goes
when its holder lets go), then checks the report names the holder with the right bytes.
"""

from __future__ import annotations

import gc
import os
import warnings
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from leakfree.diagnostics import find_retained
from tests.integration._models import tiny_llama_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, HIDDEN = 128, 16, 2, 32


def tiny_llama(cls: Any = None) -> Any:
    torch.manual_seed(0)
    return (cls or transformers.LlamaForCausalLM)(tiny_llama_config(VOCAB))


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ))


def storage_ref(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())  # type: ignore[no-untyped-call]


def test_kept_loss_charges_the_leaf_and_grad_it_pins() -> None:
    """Training on ``inputs_embeds`` that require grad (adversarial training, attributions):
    each kept loss pins its step's embeddings leaf and their .grad through AccumulateGrad."""
    model = tiny_llama()
    kept: list[torch.Tensor] = []
    refs = []
    for _ in range(3):
        tokens = ids()
        embeds = model.get_input_embeddings()(tokens).detach().requires_grad_()
        loss = model(inputs_embeds=embeds, labels=tokens).loss
        loss.backward()
        assert embeds.grad is not None
        refs.append((storage_ref(embeds), storage_ref(embeds.grad)))
        kept.append(loss)
    del embeds, loss
    gc.collect()
    assert not any(r.expired() for pair in refs for r in pair)  # only the graphs hold them

    report = find_retained(kept, model, names=["kept", "model"])
    graphs = {r.where: r.nbytes for r in report if r.kind == "graph"}
    leaf = BATCH * SEQ * HIDDEN * 4
    # the loss itself (4 B), its leaf and the leaf's .grad; parameters live anyway
    assert graphs == {f"kept[{i}]": 4 + 2 * leaf for i in range(3)}
    assert "of leaves and their .grad" in str(report)

    kept.clear()
    gc.collect()
    assert all(r.expired() for pair in refs for r in pair)


class Logged(transformers.LlamaForCausalLM):  # type: ignore[misc]
    history: list[torch.Tensor] = []  # shared by every instance, lives with the class


def test_class_level_history_is_walked() -> None:
    model = tiny_llama(Logged)
    try:
        for _ in range(3):
            out = model(input_ids=ids(), labels=ids())
            out.loss.backward()
            Logged.history.append(out.loss)  # with its graph: a real leak
        del out
        ref = storage_ref(Logged.history[0])
        report = find_retained(model, names=["model"])
        assert {r.where for r in report if r.kind == "graph"} == {
            f"Logged.history[{i}]" for i in range(3)
        }
        assert not ref.expired()
    finally:
        Logged.history.clear()
    gc.collect()
    assert ref.expired()


def test_detached_growth_is_explained_with_its_holder() -> None:
    model = tiny_llama()
    model.history = []
    for _ in range(4):
        out = model(input_ids=ids(), labels=ids())
        out.loss.backward()
        model.history.append(out.logits.detach())  # no graph, but it grows every step
    del out
    assert not find_retained(model, names=["model"]).detached  # quiet: one report cannot tell
    report = find_retained(model, names=["model"], everything=True)
    assert not report  # no graph and no ctx state kept: nothing backward should free
    logits = BATCH * SEQ * VOCAB * 4
    [held] = report.detached
    assert (held.where, held.nbytes) == ("model.history", 4 * logits)
    assert report.detached_bytes == 4 * logits
    text = str(report)
    assert "no graph kept" in text and "model.history" in text
    # the model's own buffers (rotary inv_freq) and parameters are not reported
    assert all(r.where == "model.history" for r in report.detached)


bnb = pytest.importorskip("bitsandbytes")


class QLoRALinear(torch.nn.Module):
    """A frozen 4-bit layer plus a trainable rank-4 update: ``base(x) + up(down(x))``."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.base = bnb.nn.Linear4bit(
            n_in, n_out, bias=False, compute_dtype=torch.float32, quant_type="nf4"
        )
        self.down = torch.nn.Linear(n_in, 4, bias=False)
        self.up = torch.nn.Linear(4, n_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def qlora() -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(QLoRALinear(64, 64), torch.nn.GELU(), QLoRALinear(64, 16))
    return model.to("cpu")  # quantizes the 4-bit weights


def test_4bit_weight_on_matmul4bit_ctx_is_not_flagged() -> None:
    model = qlora()
    kept: list[torch.Tensor] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            out = model(torch.randn(8, 64)).square().mean()
            out.backward()
            kept.append(out)  # a kept graph: a real (small) leak
    del out
    nodes = [
        n
        for n in _nodes(kept[0].grad_fn)
        if type(n).__name__ == "MatMul4BitBackward"  # bitsandbytes.autograd._functions
    ]
    assert len(nodes) == 1  # the second layer: its input needs a gradient, the first's not
    weight = nodes[0].tensors[1]  # a view of the Params4bit: it lives with the model anyway
    assert isinstance(weight._base, bnb.nn.Params4bit)
    assert not weight._base.requires_grad  # frozen: only the adapters train

    report = find_retained(kept, names=["kept"])
    flagged = [r.where for r in report if r.kind == "ctx attribute"]
    assert not any(w.startswith("MatMul4Bit.") for w in flagged), str(report)
    assert {r.where for r in report if r.kind == "graph"} == {"kept[0]", "kept[1]"}


def _nodes(root: Any) -> list[Any]:
    out, stack, seen = [], [root], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return out
