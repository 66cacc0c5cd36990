"""Real autograd Functions from installed packages, with and without release_after_backward.

For each Function class, a small training step that uses it (the way the package's own
modules do) runs ``--steps`` times after ``--warmup`` steps, once on the untouched class and
once under ``leakfree.release_after_backward(cls)``, with the same seeds. Every step's loss
is logged the common, buggy way (``history.append(loss)``, no ``.item()``), so each step's
graph, and with it each backward node and its ``ctx``, stays alive.

A row can name several classes of one model (all released at once). Measured, per step
(median, with min-max over the measured steps):

* **ctx state retained**: bytes of the tensor storages reachable from the attributes on the
  ``ctx`` of that step's nodes of the class (not ``saved_tensors``, which autograd frees),
  found by walking ``ctx.__dict__`` after forward and followed with ``StorageWeakRef``:
  counted if the storage is still alive after the last step while the losses are held,
  and is freed once the losses are dropped. Storages that live anyway (parameters, a
  quantized weight, the layer's quantization state) are not counted.
* **live growth**: growth per step of the live bytes of every tensor storage an aten op
  created during the steps (:class:`leakfree.diagnostics.StorageTracker`), ctx or not; it
  includes the logged loss itself (4 B, a float32 scalar). Storages made below the
  dispatcher are not seen: ``torch.get_rng_state()``, which ``CheckpointFunction`` keeps on
  ctx, shows only in the first column.
* **same grads**: every parameter gradient of every step ``torch.equal`` between the runs.

Then, per package, the number of Function classes ``leakfree.patch_functions(package)``
sweeps, in a fresh interpreter: right after ``import package``, and after importing every
module of the package whose source defines a class deriving from a ``...Function`` base.

    python benchmarks/real_functions.py [--quick] [--steps N] [--no-sweep] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import statistics
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json

import leakfree
from leakfree._text import format_bytes
from leakfree._walk import walk
from leakfree.diagnostics import StorageTracker

#: A training step: runs forward on step ``i``'s batch and returns the scalar loss.
Step = Callable[[int], torch.Tensor]


@dataclass(frozen=True)
class Case:
    """One row: a real Function class and a small training step that goes through it."""

    package: str
    module: str
    names: tuple[str, ...]  # the Function classes, imported only when the row runs
    setup: str
    build: Callable[[], tuple[torch.nn.Module, Step]]

    @property
    def functions(self) -> list[str]:
        return [f"{self.module}.{name}" for name in self.names]

    def classes(self) -> list[type[torch.autograd.Function]]:
        module = importlib.import_module(self.module)
        return [getattr(module, name) for name in self.names]


# --- the steps ----------------------------------------------------------------------------


def _mse(out: torch.Tensor, i: int) -> torch.Tensor:
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(10_000 + i))
    # Not F.mse_loss: its CPU result sits in a 64-byte storage; this one's is 4 bytes.
    return (out.float() - target).pow(2).mean()


def _batch(i: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(i))


def _checkpoint() -> tuple[torch.nn.Module, Step]:
    from torch.utils.checkpoint import checkpoint

    blocks = [
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Dropout(0.1))
        for _ in range(4)
    ]
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), *blocks, torch.nn.Linear(64, 1))

    def step(i: int) -> torch.Tensor:
        h = model[0](_batch(i, 16, 32))
        for block in blocks:
            h = checkpoint(block, h, use_reentrant=True)
        return _mse(model[-1](h), i)

    return model, step


def _cross_map_lrn() -> tuple[torch.nn.Module, Step]:
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.CrossMapLRN2d(5),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 1),
    )
    return model, lambda i: _mse(model(_batch(i, 4, 3, 16, 16)), i)


def _per_sample_grads() -> tuple[torch.nn.Module, Step]:
    from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    per_sample = call_for_per_sample_grads(model)
    return model, lambda i: _mse(per_sample(_batch(i, 16, 32)), i)


def _bnb(layer: Callable[[], torch.nn.Module], *, train: bool) -> tuple[torch.nn.Module, Step]:
    quantized = layer()
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), quantized, torch.nn.ReLU(), torch.nn.Linear(64, 1)
    )
    model.train(train)
    return model, lambda i: _mse(model(_batch(i, 16, 32)), i)


def _matmul_8bit_fp() -> tuple[torch.nn.Module, Step]:
    import bitsandbytes as bnb

    return _bnb(lambda: bnb.nn.Linear8bitLt(64, 64, has_fp16_weights=True), train=True)


def _matmul_8bit_lt() -> tuple[torch.nn.Module, Step]:
    import bitsandbytes as bnb

    def frozen() -> torch.nn.Module:
        layer = bnb.nn.Linear8bitLt(64, 64, has_fp16_weights=False)
        return layer.to("cpu")  # quantizes the weight to int8

    return _bnb(frozen, train=False)


def _matmul_4bit() -> tuple[torch.nn.Module, Step]:
    import bitsandbytes as bnb

    def frozen() -> torch.nn.Module:
        layer = bnb.nn.Linear4bit(64, 64, compute_dtype=torch.float32)
        return layer.to("cpu")  # quantizes the weight to nf4 / fp4

    return _bnb(frozen, train=True)


def _loha() -> tuple[torch.nn.Module, Step]:
    import peft

    base = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    config = peft.LoHaConfig(r=4, target_modules=["0", "2"])
    model = peft.get_peft_model(base, config)
    return model, lambda i: _mse(model(_batch(i, 16, 32)), i)


def _bloom_gelu() -> tuple[torch.nn.Module, Step]:
    import transformers

    config = transformers.BloomConfig(
        vocab_size=128, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0
    )
    model = transformers.BloomForCausalLM(config).train()

    def step(i: int) -> torch.Tensor:
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i))
        return model(input_ids=ids, labels=ids).loss

    return model, step


def _sewd_softmax() -> tuple[torch.nn.Module, Step]:
    import transformers

    config = transformers.SEWDConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=(32, 32),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        squeeze_factor=1,
        position_buckets=16,
        max_position_embeddings=64,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        activation_dropout=0.1,
        mask_time_prob=0.0,  # SpecAugment draws from numpy's global RNG
    )
    model = transformers.SEWDModel(config).train()

    def step(i: int) -> torch.Tensor:
        out = model(_batch(i, 2, 800)).last_hidden_state
        return _mse(out, i)

    return model, step


def _reformer() -> tuple[torch.nn.Module, Step]:
    import transformers

    config = transformers.ReformerConfig(
        vocab_size=128,
        hidden_size=32,
        num_attention_heads=2,
        attention_head_size=16,
        attn_layers=["lsh", "local", "lsh", "local"],
        axial_pos_shape=(4, 8),
        axial_pos_embds_dim=(16, 16),
        feed_forward_size=64,
        lsh_attn_chunk_length=8,
        local_attn_chunk_length=8,
        num_buckets=4,
        num_hashes=2,
        is_decoder=True,
        max_position_embeddings=32,
        # Reversible layers reseed the global RNG from entropy in training: no dropout, and
        # a fixed hashing seed, so both runs draw the same buckets.
        hidden_dropout_prob=0.0,
        lsh_attention_probs_dropout_prob=0.0,
        local_attention_probs_dropout_prob=0.0,
        hash_seed=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    model = transformers.ReformerModelWithLMHead(config).train()

    def step(i: int) -> torch.Tensor:
        ids = torch.randint(2, 128, (2, 32), generator=torch.Generator().manual_seed(i))
        return model(input_ids=ids, labels=ids).loss

    return model, step


def _ibert() -> tuple[torch.nn.Module, Step]:
    import transformers

    config = transformers.IBertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        quant_mode=True,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.IBertForSequenceClassification(config).train()

    def step(i: int) -> torch.Tensor:
        ids = torch.randint(2, 128, (2, 16), generator=torch.Generator().manual_seed(i))
        return model(input_ids=ids, labels=torch.tensor([0, 1])).loss

    return model, step


CASES = [
    Case(
        "torch",
        "torch.utils.checkpoint",
        ("CheckpointFunction",),
        "4 blocks, checkpoint(use_reentrant=True)",
        _checkpoint,
    ),
    Case(
        "torch",
        "torch.nn.modules._functions",
        ("CrossMapLRN2d",),
        "nn.CrossMapLRN2d after a conv",
        _cross_map_lrn,
    ),
    Case(
        "torch",
        "torch.nn.utils._expanded_weights.linear_expanded_weights",
        ("LinearPerSampleGrad",),
        "call_for_per_sample_grads(MLP)",
        _per_sample_grads,
    ),
    Case(
        "bitsandbytes",
        "bitsandbytes.autograd._functions",
        ("MatMul8bitFp",),
        "Linear8bitLt, fp16 weights, train (CPU path)",
        _matmul_8bit_fp,
    ),
    Case(
        "bitsandbytes",
        "bitsandbytes.autograd._functions",
        ("MatMul8bitLt",),
        "Linear8bitLt, frozen int8, eval mode",
        _matmul_8bit_lt,
    ),
    Case(
        "bitsandbytes",
        "bitsandbytes.autograd._functions",
        ("MatMul4Bit",),
        "Linear4bit, frozen 4-bit weight",
        _matmul_4bit,
    ),
    Case(
        "peft",
        "peft.tuners.loha.layer",
        ("HadaWeight",),
        "LoHa adapter on an MLP",
        _loha,
    ),
    Case(
        "transformers",
        "transformers.models.reformer.modeling_reformer",
        ("_ReversibleFunction",),
        "tiny ReformerModelWithLMHead, train",
        _reformer,
    ),
    Case(
        "transformers",
        "transformers.models.ibert.quant_modules",
        ("FixedPointMul", "SymmetricQuantFunction"),
        "tiny IBertForSequenceClassification, quant_mode",
        _ibert,
    ),
    Case(
        "transformers",
        "transformers.models.bloom.modeling_bloom",
        ("GeLUFunction",),
        "tiny BloomForCausalLM, train",
        _bloom_gelu,
    ),
    Case(
        "transformers",
        "transformers.models.sew_d.modeling_sew_d",
        ("XSoftmax", "XDropout"),
        "tiny SEWDModel, train",
        _sewd_softmax,
    ),
]


# --- measuring ------------------------------------------------------------------------------


def _nodes(root: Any, kinds: set[type]) -> Iterator[Any]:
    """The nodes of the graph under ``root`` whose type is one of ``kinds``."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node) in kinds:
            yield node
        stack.extend(fn for fn, _ in node.next_functions)


@dataclass
class Run:
    retained: list[int]  # per measured step: bytes only that step's ctx state kept alive
    growth: list[int]  # per measured step: growth of all live tensor bytes
    grads: list[list[torch.Tensor | None]]  # per step, per parameter
    nodes: int  # nodes of the class per step


def run(case: Case, classes: list[type], *, release: bool, warmup: int, steps: int) -> Run:
    torch.manual_seed(0)
    model, step = case.build()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=1e-3)
    handles = [leakfree.release_after_backward(c) for c in classes] if release else []
    kinds = {c._backward_cls for c in classes}  # type: ignore[attr-defined]
    refs: dict[int, tuple[StorageWeakRef, int, int]] = {}  # storage -> (ref, bytes, step)
    history: list[torch.Tensor] = []  # logged losses, graphs and all: the common bug
    grads: list[list[torch.Tensor | None]] = []
    live: list[int] = []
    nodes = 0
    tracker = StorageTracker()
    # What exists now (the imports' objects, the model) lives through the run: set aside,
    # so each step's collection scans only what the steps made (0.17 s -> ms per collect)
    gc.collect()
    gc.freeze()
    try:
        # One step more than measured: the model may still hold the newest step's state (a
        # quantization scale it keeps as its latest), which then lives anyway.
        for i in range(warmup + steps + 1):
            with tracker:
                torch.manual_seed(i)  # dropout draws the same masks in both runs
                optimizer.zero_grad()
                loss = step(i)
                nodes = _watch_ctx(loss.grad_fn, kinds, refs, i)
                loss.backward()
                optimizer.step()
                history.append(loss)
                del loss
            # Outside the tracker: the copies kept for the comparison are not the step's.
            grads.append([None if p.grad is None else p.grad.clone() for p in params])
            gc.collect()
            live.append(sum(tracker.live_bytes().values()))
    finally:
        gc.unfreeze()
        for handle in handles:
            handle.restore()
    held = {key: ref for key, (ref, _, _) in refs.items() if not ref.expired()}
    history.clear()
    gc.collect()
    retained = [0] * steps
    for key, ref in held.items():
        _, nbytes, i = refs[key]
        if ref.expired() and warmup <= i < warmup + steps:  # freed with the losses: kept
            retained[i - warmup] += nbytes  # by that step's graph
    growth = [b - a for a, b in zip(live[warmup - 1 :], live[warmup : warmup + steps])]
    return Run(retained, growth, grads, nodes)


def _watch_ctx(
    root: Any, kinds: set[type], refs: dict[int, tuple[StorageWeakRef, int, int]], i: int
) -> int:
    """Watch the storages reachable from the ctx attributes of the ``kinds`` nodes under
    ``root``, first seen at step ``i``; how many such nodes there are. Holds nothing."""
    count = 0
    for node in _nodes(root, kinds):
        count += 1
        for value in list(node.__dict__.values()):
            for tensor, _ in walk(value):
                try:
                    if tensor.layout != torch.strided or tensor.device.type == "meta":
                        continue
                    storage = tensor.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue  # a wrapper subclass with no storage of its own
                key = storage._cdata
                seen = refs.get(key)
                if seen is not None and not seen[0].expired():
                    continue  # the storage of an earlier step (a parameter, layer state)
                refs[key] = (StorageWeakRef(storage), storage.nbytes(), i)
    return count


def _same(a: list[list[torch.Tensor | None]], b: list[list[torch.Tensor | None]]) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y)
        and all(
            (p is None and q is None) or (p is not None and q is not None and torch.equal(p, q))
            for p, q in zip(x, y)
        )
        for x, y in zip(a, b)
    )


def _spread(values: list[int]) -> dict[str, Any]:
    med = statistics.median(values)
    return {"median": med, "min": min(values), "max": max(values), "per_step": values}


def _cell(values: list[int]) -> str:
    med, low, high = statistics.median(values), min(values), max(values)
    text = format_bytes(med)
    return text if low == high else f"{text} ({format_bytes(low)}-{format_bytes(high)})"


def measure(case: Case, *, warmup: int, steps: int) -> dict[str, Any]:
    try:
        classes = case.classes()
        plain = run(case, classes, release=False, warmup=warmup, steps=steps)
        released = run(case, classes, release=True, warmup=warmup, steps=steps)
    except Exception as exc:  # a package or kernel missing on this machine: say so
        return {
            "package": case.package,
            "functions": case.functions,
            "setup": case.setup,
            "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200],
        }
    return {
        "package": case.package,
        "functions": case.functions,
        "setup": case.setup,
        "nodes_per_step": plain.nodes,
        "retained_per_step": {
            "plain": _spread(plain.retained),
            "released": _spread(released.retained),
        },
        "growth_per_step": {"plain": _spread(plain.growth), "released": _spread(released.growth)},
        "same_grads": _same(plain.grads, released.grads),
        "cells": [
            _cell(plain.retained),
            _cell(released.retained),
            _cell(plain.growth),
            _cell(released.growth),
        ],
    }


# --- the sweep counts -----------------------------------------------------------------------

_SWEEP = r"""
import importlib, json, pathlib, re, sys, warnings, logging
warnings.simplefilter("ignore")
logging.disable(logging.CRITICAL)
import leakfree
pkg = sys.argv[1]
top = importlib.import_module(pkg)
sweep = leakfree.patch_functions(pkg)
on_import = len(sweep.classes)
root = pathlib.Path(top.__file__).parent
pattern = re.compile(r"^\s*class\s+\w+\([^)]*Function\b[^)]*\)\s*:", re.M)
tried, failed = 0, []
for path in sorted(root.rglob("*.py")):
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        continue
    if not pattern.search(text):
        continue
    parts = path.relative_to(root.parent).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    tried += 1
    try:
        importlib.import_module(name)
    except BaseException as exc:
        failed.append(f"{name}: {type(exc).__name__}")
classes = sorted(f"{c.__module__}.{c.__qualname__}" for c in sweep.classes)
sweep.remove()
print(json.dumps({"on_import": on_import, "swept": len(classes), "modules_tried": tried,
                  "modules_failed": failed, "classes": classes}))
"""


def sweep_count(package: str) -> dict[str, Any]:
    try:
        done = subprocess.run(
            [sys.executable, "-c", _SWEEP, package],
            cwd=Path(__file__).resolve().parents[1],  # this checkout's leakfree
            capture_output=True,
            text=True,
            timeout=240,
        )
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 240 s"}
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (CI smoke run)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per run")
    parser.add_argument("--no-sweep", action="store_true", help="skip the sweep counts")
    parser.add_argument(
        "--only", action="append", default=None, help="run only the rows of this class name"
    )
    parser.add_argument("--json", default=None, help="where to write the JSON result")
    args = parser.parse_args(argv)
    warmup, steps = 2, args.steps or (3 if args.quick else 8)
    torch.set_num_threads(1)  # deterministic kernels and a fair share of a busy machine
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)  # bitsandbytes logs a line per missing optional kernel

    cases = [c for c in CASES if args.only is None or set(c.names) & set(args.only)]
    results = [measure(case, warmup=warmup, steps=steps) for case in cases]
    rows = []
    for r in results:
        short = " + ".join(f.rsplit(".", 1)[-1] for f in r["functions"])
        if "error" in r:
            rows.append(
                (r["package"], short, r["setup"], "-", "n/a", "n/a", "n/a", "n/a", r["error"])
            )
        else:
            same = "yes" if r["same_grads"] else "NO"
            rows.append((r["package"], short, r["setup"], r["nodes_per_step"], *r["cells"], same))
    print_table(
        f"bytes per training step, median (min-max) over {steps} steps after {warmup} warm-up;"
        " losses logged with history.append(loss)",
        [
            "package",
            "Function",
            "step",
            "nodes/step",
            "ctx state kept: plain",
            "released",
            "live growth: plain",
            "released",
            "same grads",
        ],
        rows,
    )
    payload: dict[str, Any] = {
        "warmup": warmup,
        "steps": steps,
        "versions": {p: _version(p) for p in ("torch", "bitsandbytes", "peft", "transformers")},
        "results": results,
    }
    if not args.no_sweep:
        sweeps = {p: sweep_count(p) for p in ("bitsandbytes", "peft", "transformers", "torch")}
        payload["sweep"] = sweeps
        print_table(
            "Function classes leakfree.patch_functions(package) sweeps",
            [
                "package",
                "version",
                "after import",
                "after importing the modules defining them",
                "modules tried (failed)",
            ],
            [
                (
                    p,
                    payload["versions"][p],
                    s.get("on_import", "n/a"),
                    s.get("swept", s.get("error")),
                    f"{s.get('modules_tried', 0)} ({len(s.get('modules_failed', []))})",
                )
                for p, s in sweeps.items()
            ],
        )
    write_json("real_functions", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
