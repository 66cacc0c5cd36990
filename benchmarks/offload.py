"""OffloadActivations vs no offloading vs TRL's class vs torch's save_on_cpu, in one run.

CPU (always): per-saved-tensor hook cost (pack + unpack) and live bytes over steps.
leakfree runs with force_host_copy=True so its whole path executes; TRL's class is tried
and reported as not runnable where it raises (it needs an accelerator).
Simulated accelerator (``tests/simdev``, where this torch supports it): the 4-block MLP at
widths 64 and 512 and a tiny Llama, seven modes side by side (none, save_on_cpu, TRL's
class and manager, leakfree plain, with a device budget of half what it moves, and with a
budget that keeps everything): step time and its ratios, copies per step, Python calls per
saved tensor, device peaks, bit-identical gradients, flat device memory
(``_offload_sim.py``). With --quick: width 64 and the Llama, 3 rounds x 1 step, and no H100
model tables (they take minutes on a CPU; ``tests/integration/test_h100_model.py`` checks them).
H100 model (``_offload_h100.py``): the H100 run's tables predicted beside the measured
ones, and today's modes and goals on the same model (predicted, not measured).
Accelerator (when present): peak memory and step time of each mode.

    python benchmarks/offload.py [--quick] [--steps N] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _offload_h100
import _offload_sim
from _common import StorageWatch, compare, print_table, write_json

import leakfree

_offload_sim.register()  # before this process's first backward


def make_model(d: int, layers: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.LayerNorm(d)]
    return nn.Sequential(*blocks).to(device)


def make_llama(device: torch.device) -> nn.Module:
    """A tiny Llama (2 layers, hidden 64, vocabulary 256) from a config, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=128,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device)


def sim_workloads(device: torch.device, quick: bool) -> list[_offload_sim.Workload]:
    """The MLP (batch 32) at widths 64 and 512 (64 only with --quick) and the tiny Llama
    (batch 4, sequence 64), inputs made on the device once."""
    out = []
    for width in (64,) if quick else (64, 512):
        x = torch.randn(32, width, device=device)
        out.append(
            _offload_sim.Workload(
                f"4-block MLP, width {width}, batch 32 (no output head, so TRL's manager and "
                "leakfree offload every layer); a step = forward + backward of "
                "model(x).square().mean()",
                make_model(width, 4, device),
                lambda m, x=x: m(x).square().mean(),
                has_head=False,
            )
        )
    if importlib.util.find_spec("transformers") is None:
        print("\n(transformers is not installed: no tiny Llama on the simulated device)")
        return out
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1)).to(device)
    out.append(
        _offload_sim.Workload(
            "tiny Llama (2 layers, hidden 64, 4 heads, vocab 256), batch 4 x sequence 64; "
            "a step = forward + backward of model(ids, labels=ids).loss",
            make_llama(device),
            lambda m: m(ids, labels=ids).loss,
            has_head=True,
        )
    )
    return out


def sim_section(quick: bool) -> dict[str, Any] | str:
    """The side-by-side tables on the simulated accelerator, or why they were not run."""
    if torch.accelerator.is_available():  # its modes would pick the real device's streams
        return "not run: a real accelerator is present (see the accelerator section)"
    with _offload_sim.simulated_device() as sim:
        if sim is None:
            return f"not run: the simulated device does not support torch {torch.__version__}"
        return {
            "device": "sim (tests/simdev: host memory, one Python kernel per aten op)",
            "models": [
                _offload_sim.measure(w, sim, quick) for w in sim_workloads(sim.device, quick)
            ],
        }


def trl_factory(device: torch.device) -> tuple[Callable[[], Any] | None, str]:
    try:
        from trl.models.activation_offloading import OffloadActivations as TRLOffload
    except Exception as e:  # not installed
        return None, f"not installed ({type(e).__name__})"
    try:
        TRLOffload()
    except Exception as e:
        return None, f"raises {type(e).__name__} on this machine"
    import trl

    return (lambda: TRLOffload()), f"trl {trl.__version__}"


def modes(device: torch.device) -> dict[str, Callable[[], Any] | None]:
    cpu = device.type == "cpu"
    out: dict[str, Callable[[], Any] | None] = {
        "no offloading": contextlib.nullcontext,
        "leakfree": (lambda: leakfree.OffloadActivations(force_host_copy=cpu)),
        "torch save_on_cpu": (lambda: torch.autograd.graph.save_on_cpu(pin_memory=not cpu)),
    }
    trl, _ = trl_factory(device)
    out["TRL"] = trl
    return out


def count_saved(model: nn.Module, x: torch.Tensor) -> int:
    n = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal n
        n += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum()
    return n


def hook_cost(device: torch.device, quick: bool, width: int) -> tuple[list[Any], int]:
    """Step time of the 4-block MLP at ``width``: no offload, ``save_on_cpu``, leakfree with
    one manager reused and with a new manager each step (as TRL's tests do). Ratios are
    taken round by round against no offload and against ``save_on_cpu``."""
    model = make_model(width, 4, device)
    x = torch.randn(32, width, device=device)
    saved = count_saved(model, x)
    cpu = device.type == "cpu"
    reused = leakfree.OffloadActivations(force_host_copy=cpu)
    factories: dict[str, Callable[[], Any]] = {
        "no offloading": contextlib.nullcontext,
        "torch save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=not cpu),
        "leakfree, reused": lambda: reused,
        "leakfree, new each step": lambda: leakfree.OffloadActivations(force_host_copy=cpu),
    }
    fns = {}
    for name, factory in factories.items():

        def step(factory: Callable[[], Any] = factory) -> None:
            with factory():
                loss = model(x).square().mean()
            loss.backward()

        fns[name] = step
    t = compare(fns, repeat=3 if quick else 21, number=2 if quick else 20, warmup=1 if quick else 5)
    base, soc = "no offloading", "torch save_on_cpu"
    rows = [
        (
            width,
            name,
            us,
            (us - t[base]) / saved,
            str(t.ratio(name, base)),
            str(t.ratio(name, soc)),
        )
        for name, us in t.items()
    ]
    return rows, saved


def live_bytes_over_steps(device: torch.device, steps: int) -> dict[str, list[int]]:
    """Activation bytes (module outputs) plus host-copy bytes alive after each step.

    Each step runs one forward+backward and one forward whose backward never runs (a dead
    branch, as in MoE routing), which is dropped at the end of the step.
    """
    model = make_model(64, 2, device)
    x = torch.randn(32, 64, device=device)
    series: dict[str, list[int]] = {}
    for name, factory in modes(device).items():
        if factory is None:
            continue
        watch = StorageWatch()
        hooks = [
            m.register_forward_hook(lambda m, i, o, w=watch: w.watch(o)) for m in model.modules()
        ]
        ctx = factory()
        values = []
        for _ in range(steps):
            with ctx:
                loss = model(x).square().mean()
                dead = model(x * 2).sum()  # never backpropagated
            loss.backward()
            del loss, dead
            values.append(watch.live_bytes() + _pool_bytes(ctx))
        for h in hooks:
            h.remove()
        series[name] = values
    return series


def _pool_bytes(ctx: Any) -> int:
    pool = getattr(ctx, "pool", None)
    return pool.stats.in_use_bytes if pool is not None else 0


def accelerator_peaks(device: torch.device, quick: bool) -> list[Any]:
    mod = torch.get_device_module(device)
    model = make_model(2048, 8, device)
    x = torch.randn(8, 1024, 2048, device=device)
    rows = []
    for name, factory in modes(device).items():
        if factory is None:
            rows.append((name, None, None))
            continue
        times = []
        for _ in range(3 if quick else 7):
            mod.synchronize()
            mod.reset_peak_memory_stats()
            base = mod.memory_allocated()
            t0 = time.perf_counter()
            with factory():
                loss = model(x).float().square().mean()
            loss.backward()
            mod.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
            peak = (mod.max_memory_allocated() - base) / 2**20
            model.zero_grad(set_to_none=True)
            del loss
        rows.append((name, peak, sorted(times)[len(times) // 2]))
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cpu = torch.device("cpu")
    _, trl_note = trl_factory(cpu)

    rows: list[Any] = []
    for width in (64, 512):
        more, saved = hook_cost(cpu, args.quick, width)
        rows += more
    print_table(
        f"CPU: forward+backward of a 4-block MLP ({saved} saved tensors), interleaved; "
        "ratios: median (IQR) round by round",
        ["width", "mode", "us per step", "extra us per saved tensor", "vs none", "vs save_on_cpu"],
        rows,
    )
    live = live_bytes_over_steps(cpu, args.steps)
    print_table(
        "CPU: bytes of activations + host copies alive after each step (first / last / max)",
        ["mode", "step 1", f"step {args.steps}", "max"],
        [(k, v[0], v[-1], max(v)) for k, v in live.items()],
    )
    payload: dict[str, Any] = {
        "cpu_hook_cost": [
            {
                "width": r[0],
                "mode": r[1],
                "us_per_step": r[2],
                "extra_us_per_saved_tensor": r[3],
                "ratio_vs_none": r[4],
                "ratio_vs_save_on_cpu": r[5],
            }
            for r in rows
        ],
        "saved_tensors_per_step": saved,
        "cpu_live_bytes": live,
        "trl": trl_note,
    }
    payload["sim"] = sim_section(args.quick)
    if isinstance(payload["sim"], str):
        print(f"\n(simulated accelerator: {payload['sim']})")
    # The H100 model's tables take minutes on a CPU; tests/integration/test_h100_model.py
    # checks what they say, so a quick run leaves them out.
    payload["h100_model"] = (
        "not run under --quick (the H100 model's tables: benchmarks/offload.py without it)"
        if args.quick
        else _offload_h100.section()
    )
    if isinstance(payload["h100_model"], str):
        print(f"\n(H100 model: {payload['h100_model']})")
    if torch.accelerator.is_available():
        device = torch.accelerator.current_accelerator()
        assert device is not None
        peaks = accelerator_peaks(device, args.quick)
        print_table(
            f"{device}: peak memory and step time, 8 blocks of d=2048, batch 8x1024",
            ["mode", "peak MiB", "step ms"],
            peaks,
        )
        payload["accelerator"] = [{"mode": r[0], "peak_mib": r[1], "step_ms": r[2]} for r in peaks]
    else:
        print("\n(no accelerator: peak memory and step time are measured on GPU only)")
    write_json("offload", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
