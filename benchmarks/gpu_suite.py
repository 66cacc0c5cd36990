"""The GPU suite: a causal LM trained six ways, LossLog's host syncs, a real memory snapshot.

    python benchmarks/gpu_suite.py                # on the accelerator, the full size
    python benchmarks/gpu_suite.py --tiny         # smoke sizes (CPU, the test suite's device)

The model is a Llama-style causal LM built from a ``transformers`` config with random
weights (default hidden 2048, 8 layers, sequence 4096, bf16). Its activations are kept six
ways, each on its own copy of the model, steps interleaved round by round so that a noisy
machine slows every mode alike:

* ``none``: plain PyTorch;
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``;
* ``trl class``: TRL's ``OffloadActivations()``, a new one each step, as TRL's own usage;
* ``trl``: TRL's ``get_act_offloading_ctx_manager`` (where TRL is installed and runs);
* ``leakfree``: ``leakfree.offload.offload_model``;
* ``leakfree budget``: the same with ``device_budget`` = half the bytes ``leakfree`` moves
  to the host in one step (measured first, on a copy of its own).

Reported per mode: step time (median and IQR of its ratio to ``none``, round by round),
peak memory, activation peak (peak minus the memory held at the start of the step),
memory after each step, and whether the first step's gradients are bit-identical to
``none`` (deterministic algorithms on). Then: ``LossLog.reduce`` host syncs (on CUDA by
``torch.cuda.set_sync_debug_mode``; elsewhere by ``leakfree.diagnostics.count_host_syncs``),
and, on CUDA, a ``torch.cuda.memory._snapshot()`` of a leakfree step analysed by
``leakfree snapshot``.

Goals on a GPU ([3/6]): leakfree's step time at most 1/0.95 of ``none``'s, its activation
peak at least 40% lower, and ahead of TRL on both. Results go to
``benchmarks/results/gpu_suite.json`` (or ``--json PATH``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import os
import pickle
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, Spread, print_table, write_json

import leakfree
from leakfree.diagnostics import count_host_syncs
from leakfree.offload import offload_model

MODES = ("none", "save_on_cpu", "trl class", "trl", "leakfree", "leakfree budget")
FULL = {"hidden": 2048, "layers": 8, "seq": 4096, "batch": 1, "vocab": 32000, "steps": 10}
TINY = {"hidden": 64, "layers": 2, "seq": 64, "batch": 2, "vocab": 256, "steps": 3}


@dataclass
class Run:
    """One mode: its model, optimizer, context factory and what was measured."""

    name: str
    model: Any
    optimizer: torch.optim.Optimizer
    context: Callable[[], Any]
    times: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    activation_peaks: list[int] = field(default_factory=list)
    after_step: list[int] = field(default_factory=list)
    error: str | None = None


class Memory:
    """Allocator statistics of ``device`` where its module has them (None elsewhere)."""

    def __init__(self, device: torch.device) -> None:
        module = torch.get_device_module(device.type) if device.type != "cpu" else None
        self.module = module if module is not None and hasattr(module, "memory_allocated") else None

    def sync(self) -> None:
        if self.module is not None:
            self.module.synchronize()

    def allocated(self) -> int | None:
        return None if self.module is None else int(self.module.memory_allocated())

    def reset_peak(self) -> None:
        if self.module is not None:
            self.module.reset_peak_memory_stats()

    def peak(self) -> int | None:
        return None if self.module is None else int(self.module.max_memory_allocated())


def build_model(size: dict[str, int], device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = size["hidden"]
    heads = max(1, hidden // 128) if hidden >= 128 else 4
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3) // 64 * 64 or 4 * hidden,
        num_hidden_layers=size["layers"],
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=size["vocab"],
        max_position_embeddings=size["seq"],
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def context(
    name: str, model: Any, device: torch.device, budget: int | None = None
) -> Callable[[], Any]:
    """Mode ``name``'s context for one step of ``model``. Only that mode touches the model:
    TRL's and leakfree's helpers register hooks on its head, which the other modes'
    models must not carry. ``budget``: the ``leakfree budget`` mode's device budget (None:
    not measured). A mode that cannot run here raises with the reason."""
    cpu = device.type == "cpu"
    if name == "none":
        return contextlib.nullcontext
    if name == "save_on_cpu":
        return lambda: torch.autograd.graph.save_on_cpu(pin_memory=not cpu)
    if name in ("trl", "trl class"):
        try:
            from trl.models import activation_offloading as trl_offload

            if name == "trl class":
                trl_offload.OffloadActivations()  # raises where TRL cannot run
                return trl_offload.OffloadActivations
            trl_ctx = trl_offload.get_act_offloading_ctx_manager(model)
        except Exception as e:  # not installed, or not on this machine
            return _raiser(f"{type(e).__name__}: {e}")
        return lambda: trl_ctx
    if name == "leakfree budget":
        if "device_budget" not in inspect.signature(leakfree.OffloadActivations).parameters:
            return _raiser("not available: OffloadActivations has no device_budget")
        if budget is None:
            return _raiser("not available: what leakfree moves was not measured")
        ctx = offload_model(model, force_host_copy=cpu, device_budget=budget)
        return lambda: ctx
    ctx = offload_model(model, force_host_copy=cpu)
    return lambda: ctx


def leakfree_budget(
    size: dict[str, int], device: torch.device, dtype: torch.dtype, ids: torch.Tensor
) -> int | None:
    """Half the bytes ``leakfree`` copies to the host in one step of a fresh model (its
    ``stats``): the ``leakfree budget`` mode's device budget. None where that step fails."""
    model = build_model(size, device, dtype)
    try:
        ctx = offload_model(model, force_host_copy=device.type == "cpu")
        with ctx:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return int(ctx.stats.to_host_bytes) // 2
    except Exception:
        return None
    finally:
        del model
        gc.collect()


def _raiser(message: str) -> Callable[[], Any]:
    def fail() -> Any:
        raise RuntimeError(message)

    return fail


def batch(size: dict[str, int], device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=g)
    return ids.to(device)


def step(run: Run, ids: torch.Tensor, memory: Memory, *, update: bool = True) -> None:
    memory.sync()
    start = memory.allocated()
    memory.reset_peak()
    t0 = time.perf_counter()
    with run.context():
        loss = run.model(input_ids=ids, labels=ids).loss
    loss.backward()
    if update:
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
    memory.sync()
    run.times.append(time.perf_counter() - t0)
    peak = memory.peak()
    if peak is not None and start is not None:
        run.peaks.append(peak)
        run.activation_peaks.append(peak - start)
        run.after_step.append(int(memory.allocated() or 0))


def grads_identical(
    size: dict[str, int],
    device: torch.device,
    dtype: torch.dtype,
    ids: torch.Tensor,
    budget: int | None = None,
) -> dict[str, bool | str]:
    """One forward and backward per mode, deterministic algorithms on: are the gradients
    bit-identical to plain PyTorch's?"""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    out: dict[str, bool | str] = {}
    try:
        reference: list[torch.Tensor] | None = None
        for name in MODES:
            model = build_model(size, device, dtype)
            try:
                with context(name, model, device, budget)():
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            except Exception as e:
                out[name] = f"failed: {type(e).__name__}: {e}"[:200]
                continue
            got = [p.grad.detach().cpu() for p in model.parameters() if p.grad is not None]
            if reference is None:
                reference = got
            out[name] = len(got) == len(reference) and all(
                torch.equal(a, b) for a, b in zip(got, reference)
            )
            del model, loss, got
            gc.collect()
    finally:
        torch.use_deterministic_algorithms(previous)
    return out


def losslog_syncs(device: torch.device, microbatches: int = 256) -> dict[str, Any]:
    keys = {"loss": "mean", "aux": "sum", "max_logit": "max"}
    log = leakfree.LossLog(keys, device=device)
    for i in range(microbatches):
        for key in keys:
            log[key].append(torch.full((), float(i), device=device))
    if device.type == "cuda":
        torch.cuda.synchronize()
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                log.reduce()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        how = "torch.cuda.set_sync_debug_mode"
    else:
        with count_host_syncs() as counter:
            log.reduce()
        syncs, how = counter.count, "leakfree.diagnostics.count_host_syncs"
    return {
        "microbatches": microbatches,
        "keys": len(keys),
        "reduce_syncs": syncs,
        "item_per_value_syncs": microbatches * len(keys),
        "measured_by": how,
    }


def snapshot(run: Run, ids: torch.Tensor, memory: Memory, out_dir: Path) -> dict[str, Any]:
    if run.model.device.type != "cuda":
        return {"skipped": "a memory snapshot needs CUDA"}
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        for _ in range(2):
            step(run, ids, memory)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    path = out_dir / "gpu_suite_snapshot.pickle"
    with path.open("wb") as f:
        pickle.dump(snap, f)
    proc = subprocess.run(
        [sys.executable, "-m", "leakfree", "snapshot", str(path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(proc.stdout)
    return {"file": str(path), "exit_status": proc.returncode, "report": proc.stdout[-4000:]}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu_suite.py", description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="smoke sizes, float32")
    parser.add_argument("--device", help="default: the accelerator, else the CPU")
    parser.add_argument("--steps", type=int, help="training steps per mode")
    parser.add_argument("--json", help="write results here")
    for key in ("hidden", "layers", "seq", "batch", "vocab"):
        parser.add_argument(f"--{key}", type=int)
    args = parser.parse_args(argv)
    # The folder first, and the JSON rewritten after each part: a later part that fails
    # (on a real GPU, after minutes of measurements) loses only itself.
    out = Path(args.json) if args.json else RESULTS / "gpu_suite.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {"parts_done": []}

    def save(part: str, **results: Any) -> None:
        payload.update(results)
        payload["parts_done"].append(part)
        write_json("gpu_suite", payload, str(out))

    size = dict(TINY if args.tiny else FULL)
    for key in (*size, "steps"):
        if getattr(args, key, None) is not None:
            size[key] = getattr(args, key)
    if args.device:
        device = torch.device(args.device)
    elif torch.accelerator.is_available():
        device = torch.accelerator.current_accelerator()
    else:
        device = torch.device("cpu")
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, torch.accelerator.current_device_index())
    dtype = torch.float32 if args.tiny or device.type == "cpu" else torch.bfloat16
    memory = Memory(device)
    ids = batch(size, device)
    save("setup", size=size, device=str(device), dtype=str(dtype))

    with _quiet():
        budget = leakfree_budget(size, device, dtype, ids)
        identical = grads_identical(size, device, dtype, ids, budget)
        save("gradients", leakfree_budget_bytes=budget, grads_bit_identical=identical)
        runs: list[Run] = []
        for name in MODES:
            model = build_model(size, device, dtype)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
            runs.append(Run(name, model, optimizer, context(name, model, device, budget)))
        for _ in range(size["steps"]):
            for run in runs:  # interleaved: each round takes one step of every mode
                if run.error is None:
                    try:
                        step(run, ids, memory)
                    except Exception as e:
                        run.error = f"{type(e).__name__}: {e}"[:200]
    base = next(r for r in runs if r.name == "none")
    rows, results = [], {}
    for run in runs:
        ok = run.error is None and run.times
        ratio = Spread.of([a / b for a, b in zip(run.times, base.times)]) if ok else None
        act = max(run.activation_peaks) if run.activation_peaks else None
        results[run.name] = {
            "error": run.error,
            "step_s": Spread.of(run.times).as_dict() if ok else None,
            "step_ratio_vs_none": ratio.as_dict() if ratio else None,
            "peak_bytes": max(run.peaks) if run.peaks else None,
            "activation_peak_bytes": act,
            "allocated_after_each_step": run.after_step,
            "grads_bit_identical": identical.get(run.name),
        }
        rows.append(
            [
                run.name,
                str(ratio) if ratio else (run.error or "-")[:60],
                _mib(max(run.peaks) if run.peaks else None),
                _mib(act),
                " ".join(_mib(b) for b in run.after_step) or "n/a",
                str(identical.get(run.name)),
            ]
        )
    print_table(
        f"causal LM {size} on {device} ({dtype}), {size['steps']} interleaved steps; "
        f"leakfree budget: device_budget={budget} (half of what leakfree moves per step)",
        [
            "mode",
            "step time vs none",
            "peak MiB",
            "activation peak MiB",
            "MiB after each step",
            "grads identical",
        ],
        rows,
    )
    goals = _goals(results)
    for goal, verdict in goals.items():
        print(f"{goal}: {verdict}")
    save("modes", modes=results, goals=goals)
    syncs = losslog_syncs(device)
    print_table("LossLog.reduce host syncs", list(syncs), [list(syncs.values())])
    save("losslog", losslog=syncs)
    save("snapshot", snapshot=snapshot(runs[-1], ids, memory, out.parent))
    return payload


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def _goals(results: dict[str, Any]) -> dict[str, str]:
    lf, none, trl = results["leakfree"], results["none"], results["trl"]
    if lf["step_ratio_vs_none"] is None or lf["activation_peak_bytes"] is None:
        return {"goals": "not measurable here (no allocator statistics)"}
    speed = 1 / lf["step_ratio_vs_none"]["median"]
    saving = 1 - lf["activation_peak_bytes"] / max(1, none["activation_peak_bytes"])
    goals = {
        f"speed >= 0.95x no offload (got {speed:.3f}x)": _verdict(speed >= 0.95),
        f"activation peak >= 40% lower (got {saving:.0%})": _verdict(saving >= 0.40),
    }
    if trl["step_ratio_vs_none"] is not None and trl["activation_peak_bytes"] is not None:
        faster = lf["step_ratio_vs_none"]["median"] <= trl["step_ratio_vs_none"]["median"]
        smaller = lf["activation_peak_bytes"] <= trl["activation_peak_bytes"]
        goals["ahead of TRL on step time"] = _verdict(faster)
        goals["ahead of TRL on activation peak"] = _verdict(smaller)
    else:
        goals["ahead of TRL"] = f"not measured (TRL: {trl['error']})"
    return goals


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


if __name__ == "__main__":
    main()
