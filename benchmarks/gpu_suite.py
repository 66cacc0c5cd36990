"""The GPU suite: a causal LM trained every way we compare, as one command.

    python benchmarks/gpu_suite.py --json results/gpu/suite.json    # on the GPU, full size
    python benchmarks/gpu_suite.py --tiny                           # smoke sizes (CPU, sim)

The model is the measured H100 Llama built from a ``transformers`` config with random
weights (hidden 2048, 8 layers, sequence 4096, batch 2, bf16). Its activations are kept
each of these ways, each on its own copy of the model, steps interleaved round by round so
that a noisy machine slows every mode alike:

* ``none``: plain PyTorch; ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``;
* ``trl class`` / ``trl``: TRL's ``OffloadActivations()`` (a new one each step) and its
  ``get_act_offloading_ctx_manager`` (where TRL is installed and runs);
* ``leakfree``: ``leakfree.offload.offload_model`` (the default plan);
* ``leakfree max_overhead``: ``max_overhead=0.05``; ``leakfree device_limit``: a ceiling
  1 GiB under the peak of ``none`` (a fifth under it at the tiny size);
* ``leakfree budget 0.75`` / ``0.50`` / ``0.25``: ``device_budget`` at those fractions of
  what ``leakfree`` moves per step (measured first, on a model of its own).

Parts, each written to the JSON as it ends (into a folder the suite creates): the setup;
gradients bit-identical to ``none`` after three steps of each mode (deterministic
algorithms on: a goal's plan is followed from its second step); the frontier (step time
ratio to ``none``, median and IQR round by round; peak and activation peak; memory after
each step; the plans); on CUDA, one profiled step of each leakfree mode (bytes each way,
how long both copy directions ran at once, and copies beside compute); on CUDA, PyTorch's
CUDA Sanitizer over a small model in a child process (``TORCH_CUDA_SANITIZER=1``);
``LossLog.reduce``'s host syncs; a memory snapshot analysed by ``leakfree snapshot``.
A full run takes about 3 minutes on one H100. Results go to
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

MODES = (
    "none",
    "save_on_cpu",
    "trl class",
    "trl",
    "leakfree",
    "leakfree max_overhead",
    "leakfree device_limit",
    "leakfree budget 0.75",
    "leakfree budget 0.50",
    "leakfree budget 0.25",
)
#: rounds left out of the statistics (a goal's plan measures one step and checks one)
WARMUP = 2
FULL = {"hidden": 2048, "layers": 8, "seq": 4096, "batch": 2, "vocab": 32000, "steps": 8}
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


@dataclass
class Prepared:
    """What the modes need measured first, each on a model of its own: the bytes the
    default moves per step (its third), the device memory held before a step and the
    activation peak of ``none`` (None where the device has no allocator statistics)."""

    moved: int | None = None
    held: int | None = None
    none_peak: int | None = None

    def limit(self, tiny: bool) -> int | None:
        """The ``leakfree device_limit`` mode's ceiling: 1 GiB under ``none``'s peak (a
        fifth under it at the tiny size)."""
        if self.held is None or self.none_peak is None:
            return None
        under = self.none_peak // 5 if tiny else 1 << 30
        return self.held + self.none_peak - under


def context(
    name: str, model: Any, device: torch.device, prep: Prepared | None = None, tiny: bool = False
) -> Callable[[], Any]:
    """Mode ``name``'s context for one step of ``model``. Only that mode touches the model:
    TRL's and leakfree's helpers register hooks on its head, which the other modes'
    models must not carry. ``prep``: what the budget and limit modes need (see
    :func:`prepare`). A mode that cannot run here raises with the reason."""
    cpu = device.type == "cpu"
    prep = prep or Prepared()
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
    options: dict[str, Any] = {}
    if name.startswith("leakfree budget"):
        if prep.moved is None:
            return _raiser("not available: what leakfree moves was not measured")
        options["device_budget"] = int(float(name.split()[-1]) * prep.moved)
    elif name == "leakfree max_overhead":
        options["max_overhead"] = 0.05
    elif name == "leakfree device_limit":
        limit = prep.limit(tiny)
        if limit is None:
            return _raiser("not available: no allocator statistics on this device")
        options["device_limit"] = limit
    signature = inspect.signature(leakfree.OffloadActivations).parameters
    missing = [key for key in options if key not in signature]
    if missing:
        return _raiser(f"not available: OffloadActivations has no {missing[0]}")
    ctx = offload_model(model, force_host_copy=cpu, **options)
    return lambda: ctx


def prepare(
    size: dict[str, int], device: torch.device, dtype: torch.dtype, ids: torch.Tensor
) -> Prepared:
    """Three steps of ``leakfree`` (what its plan moves in the third) and one of ``none``
    (its activation peak), each on a fresh model."""
    prep = Prepared()
    memory = Memory(device)
    for name in ("leakfree", "none"):
        model = build_model(size, device, dtype)
        run = Run(name, model, torch.optim.SGD(model.parameters(), lr=0.0), _raiser(""))
        run.context = context(name, model, device)
        try:
            for _ in range(3 if name == "leakfree" else 1):
                ctx = run.context()
                before = getattr(ctx, "stats", None)
                moved = before.to_host_bytes if before is not None else 0
                memory.sync()
                prep.held = memory.allocated()
                step(run, ids, memory, update=False)
                run.model.zero_grad(set_to_none=True)
                if name == "leakfree":
                    prep.moved = int(ctx.stats.to_host_bytes) - moved
            if name == "none" and run.activation_peaks:
                prep.none_peak = run.activation_peaks[-1]
        except Exception:
            pass
        finally:
            del model, run
            gc.collect()
    return prep


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
    prep: Prepared | None = None,
    tiny: bool = False,
) -> dict[str, bool | str]:
    """Three forwards and backwards per mode (a goal's plan is measured in the first,
    followed from the second), deterministic algorithms on: are the third's gradients
    bit-identical to plain PyTorch's?"""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    out: dict[str, bool | str] = {}
    try:
        reference: list[torch.Tensor] | None = None
        for name in MODES:
            model = build_model(size, device, dtype)
            try:
                make = context(name, model, device, prep, tiny)
                for _ in range(3):
                    model.zero_grad(set_to_none=True)
                    with make():
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


def copy_overlap(run: Run, ids: torch.Tensor, memory: Memory) -> dict[str, Any]:
    """One profiled step of ``run`` (after its measured ones): the copies each way, how
    long both directions ran at once, and how long copies ran beside compute kernels,
    from the profiler's device timeline (CUDA only)."""
    if run.model.device.type != "cuda" or run.error is not None:
        return {"skipped": run.error or "the profiler's copy timeline needs CUDA"}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(run, ids, memory)
    spans: dict[str, list[tuple[float, float]]] = {"to_host": [], "to_device": [], "compute": []}
    moved = {"to_host": 0, "to_device": 0}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (event.time_range.start, event.time_range.end)
        name = event.name
        if "Memcpy DtoH" in name:
            spans["to_host"].append(span)
            moved["to_host"] += 1
        elif "Memcpy HtoD" in name:
            spans["to_device"].append(span)
            moved["to_device"] += 1
        elif "Memcpy" not in name and "Memset" not in name:
            spans["compute"].append(span)
    union = {k: _union(v) for k, v in spans.items()}
    copies = _union(spans["to_host"] + spans["to_device"])
    ms = 1e-3
    return {
        "copies": moved,
        "to_host_ms": _length(union["to_host"]) * ms,
        "to_device_ms": _length(union["to_device"]) * ms,
        "both_directions_ms": _overlap(union["to_host"], union["to_device"]) * ms,
        "copies_beside_compute_ms": _overlap(copies, union["compute"]) * ms,
        "copy_ms": _length(copies) * ms,
    }


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


#: the CUDA Sanitizer's model: small enough for its per-kernel bookkeeping
SANITIZED = {"hidden": 256, "layers": 2, "seq": 512, "batch": 2, "vocab": 1024}


def sanitizer(device: torch.device) -> dict[str, Any]:
    """PyTorch's CUDA Sanitizer (``TORCH_CUDA_SANITIZER=1``) over four steps of each
    leakfree mode on a small model, in a child process: it raises on a race."""
    if device.type != "cuda":
        return {"skipped": "the CUDA Sanitizer needs CUDA"}
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, "--sanitizer-child", "--device", str(device)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    return {"exit_status": proc.returncode, "races": "CSAN detected" in proc.stderr,
            "output": (proc.stdout + proc.stderr)[-3000:]}  # fmt: skip


def _sanitizer_child(device: torch.device) -> None:
    ids = batch(SANITIZED, device)
    memory = Memory(device)
    with _quiet():
        prep = prepare(SANITIZED, device, torch.bfloat16, ids)
        for name in MODES:
            if not name.startswith("leakfree"):
                continue
            model = build_model(SANITIZED, device, torch.bfloat16)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
            run = Run(name, model, optimizer, context(name, model, device, prep, tiny=True))
            for _ in range(4):
                step(run, ids, memory)
            print(f"{name}: 4 steps, no race")


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
    parser.add_argument("--sanitizer-child", action="store_true", help=argparse.SUPPRESS)
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
    if args.sanitizer_child:
        _sanitizer_child(device)
        return {}
    dtype = torch.float32 if args.tiny or device.type == "cpu" else torch.bfloat16
    memory = Memory(device)
    ids = batch(size, device)
    save("setup", size=size, device=str(device), dtype=str(dtype))

    with _quiet():
        prep = prepare(size, device, dtype, ids)
        identical = grads_identical(size, device, dtype, ids, prep, args.tiny)
        save("gradients", prepared=vars(prep), grads_bit_identical=identical)
        models = {name: build_model(size, device, dtype) for name in MODES}
        memory.sync()
        prep.held = memory.allocated()  # every model: what a step of each starts from
        runs: list[Run] = []
        for name, model in models.items():
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
            make = context(name, model, device, prep, args.tiny)
            runs.append(Run(name, model, optimizer, make))
        del models
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
        # the first WARMUP rounds are left out: a goal's plan measures its first step and
        # checks its second
        times, peaks = run.times[WARMUP:], run.peaks[WARMUP:]
        acts = run.activation_peaks[WARMUP:]
        ok = run.error is None and times
        ratio = Spread.of([a / b for a, b in zip(times, base.times[WARMUP:])]) if ok else None
        act = max(acts) if acts else None
        ctx = run.context() if run.error is None and run.name.startswith("leakfree") else None
        plan = getattr(ctx, "plan", None)
        results[run.name] = {
            "error": run.error,
            "step_s": Spread.of(times).as_dict() if ok else None,
            "step_ratio_vs_none": ratio.as_dict() if ratio else None,
            "peak_bytes": max(peaks) if peaks else None,
            "activation_peak_bytes": act,
            "allocated_after_each_step": run.after_step,
            "grads_bit_identical": identical.get(run.name),
            "plan": str(plan) if plan is not None else None,
            "device_limit": getattr(ctx, "device_limit", None),
        }
        rows.append(
            [
                run.name,
                str(ratio) if ratio else (run.error or "-")[:60],
                _mib(max(peaks) if peaks else None),
                _mib(act),
                " ".join(_mib(b) for b in run.after_step) or "n/a",
                str(identical.get(run.name)),
            ]
        )
    print_table(
        f"causal LM {size} on {device} ({dtype}), {size['steps']} interleaved steps (the "
        f"first {WARMUP} left out); budgets: fractions of the {prep.moved} bytes leakfree "
        f"moves per step; device_limit: {prep.limit(args.tiny)} bytes",
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
    overlap = {r.name: copy_overlap(r, ids, memory) for r in runs if r.name.startswith("leakfree")}
    save("overlap", copy_overlap=overlap)
    save("sanitizer", sanitizer=sanitizer(device))
    syncs = losslog_syncs(device)
    print_table("LossLog.reduce host syncs", list(syncs), [list(syncs.values())])
    save("losslog", losslog=syncs)
    leakfree_run = next(r for r in runs if r.name == "leakfree")
    save("snapshot", snapshot=snapshot(leakfree_run, ids, memory, out.parent))
    return payload


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def _goals(results: dict[str, Any]) -> dict[str, str]:
    """The targets of the measured H100 Llama, measured."""
    none, trl = results["none"], results["trl"]

    def ratio(mode: str) -> float | None:
        spread = results[mode]["step_ratio_vs_none"]
        return None if spread is None else float(spread["median"])

    def lower(mode: str) -> float | None:
        act, base = results[mode]["activation_peak_bytes"], none["activation_peak_bytes"]
        return None if act is None or not base else 1 - act / base

    goals: dict[str, str] = {}
    checks = (
        ("leakfree max_overhead", 1.07, 0.15),
        ("leakfree device_limit", 1.15, None),
        ("leakfree", 2.0, 0.52),
    )
    for mode, most, least in checks:
        r, low = ratio(mode), lower(mode)
        if r is None or low is None:
            goals[mode] = f"not measured ({results[mode]['error'] or 'no allocator statistics'})"
            continue
        ok = r <= most and (least is None or low >= least)
        want = f"at most {most}x" + (f", at least {least:.0%} lower" if least else "")
        goals[f"{mode}: {want} (got {r:.2f}x, {low:.0%} lower)"] = _verdict(ok)
    t, t_low = ratio("trl"), lower("trl")
    if t is not None and t_low is not None:
        for mode in ("leakfree", "leakfree device_limit", "leakfree max_overhead"):
            r, low = ratio(mode), lower(mode)
            if r is not None and low is not None:
                goals[f"{mode} faster than TRL ({r:.2f}x against {t:.2f}x)"] = _verdict(r < t)
    else:
        goals["ahead of TRL"] = f"not measured (TRL: {trl['error']})"
    return goals


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


if __name__ == "__main__":
    main()
