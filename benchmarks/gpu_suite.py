"""The GPU suite: what the H100 model predicts for offloading, measured on a GPU, in one command.

    python benchmarks/gpu_suite.py             # on a GPU: about 2 minutes, at most 3
    python benchmarks/gpu_suite.py --dry       # anywhere: the same on the simulated H100
    python benchmarks/gpu_suite.py --dry --small   # 2 layers, a quarter of the vocabulary

The model is the measured H100 Llama (hidden 2048, 8 layers, intermediate 5440, vocab
32000, bf16, sdpa, batch 2 x 4096), random weights, built on the device itself. Parts, in
order, each in a time box (``--budget PART=SECONDS``: a part out of time stops, keeps what
it has and says so), each written to the JSON as it goes, so a run killed midway leaves
every finished part and what the running one had:

* ``link``: pinned copies device to host alone, host to device alone, both at once (side
  streams of their own, pinned buffers of their own), both beside matmuls: GB/s
  (``_suite_link.py``);
* ``frontier``: none, the leakfree default, ``max_overhead=0.05``, ``device_limit`` at
  none's held peak less 1 GiB, TRL's ``get_act_offloading_ctx_manager`` (where trl is
  importable; skipped, saying why, where not) and ``save_on_cpu(pin_memory=True)``: step
  time against none (median and IQR of interleaved rounds), allocated and held peaks
  beyond what was allocated before the step, bytes to the host, and each plan's
  predictions beside what was measured (``_suite_frontier.py``);
* ``gradients``: each leakfree goal's gradients after three steps, bit for bit against
  none's, deterministic algorithms on (``_suite_gradients.py``);
* ``shapes``: lengths cycling 4096 / 3584 / 3072: ratio and held memory each step,
  ``device_limit`` under its ceiling every step (``_suite_shapes.py``);
* ``fit``: under a cap of what none holds at 2 x 4096 (``set_per_process_memory_fraction``),
  the longest sequence none, the default, ``device_limit=cap`` and per-layer
  checkpointing train (``_suite_fit.py``).

Each leakfree manager has a pinned host budget of its own (``--pinned-gib``, 32). Then the
pass lines, each "predicted X, measured Y" against the H100 model's predictions
(``_suite_checks.py``). ``--full`` adds TRL's class, ``use_streams=False`` and three
device budgets to the frontier, a profiled step of each leakfree mode and
``LossLog.reduce``'s host syncs (about 5 minutes); ``--sanitizer`` and ``--snapshot``
add the CUDA Sanitizer (a child, waited for 2 minutes at most) and a memory snapshot read
by ``leakfree snapshot`` (1 minute at most). ``--parts`` runs a subset.

``--dry`` (or ``--tiny``) runs every part on the simulated device of ``tests/simdev``, shapes
only, timed by the H100 model (the gradients with real values, on a tiny Llama): it
prints what a GPU run should measure, every line judged, in about a minute on 2 cores
(20 s with ``--small``).

The JSON (``benchmarks/results/gpu_suite.json``, ``gpu_suite_dry.json`` dry, or
``--json PATH``): ``suite``, ``dry``, ``device``, ``size``, ``versions`` and the
``environment``; ``parts_done`` (in order) and ``running`` (the part in progress, null at
the end); ``parts.PART``: what the part measured, with ``seconds``, ``budget_s``,
``timed_out`` (null, or where it stopped), ``error`` where it raised and ``partial`` while
it runs; ``checks``: one per line, ``part``, ``what``, ``predicted``, ``measured``,
``line`` and ``verdict`` (pass, FAIL, reported, not judged or not measured, and why);
``seconds_total``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # tests.simdev, for --dry
import _suite_checks as checks
from _common import RESULTS, print_table
from _suite_device import FULL, MODES, MORE_MODES, SMALL, VALUES, Bench, GiB, Size, trl_missing
from _suite_extras import SANITIZED, losslog_syncs, profile, sanitizer, sanitizer_child, snapshot
from _suite_fit import fit
from _suite_frontier import frontier
from _suite_gradients import gradients
from _suite_link import link
from _suite_report import Report, TimeBox
from _suite_shapes import shapes

PARTS = ("link", "frontier", "gradients", "shapes", "fit")


@dataclass(frozen=True)
class Settings:
    """How much each part measures, and its time box in seconds."""

    budgets: dict[str, float]
    rounds: int  #: the frontier's measured rounds
    warmup: int  #: and the rounds left out before them
    cycles: int  #: of the shapes part's lengths
    fit_step: int  #: the fit part's step in tokens
    fit_longest: int  #: and the longest it tries
    link_bytes: int  #: each copy of the link part


#: on a GPU: with start-up (imports, the first CUDA calls: about 15 s) at most 3 minutes
GPU = Settings(
    budgets={"link": 10, "frontier": 55, "gradients": 20, "shapes": 20, "fit": 50},
    rounds=6,
    warmup=2,
    cycles=3,
    fit_step=512,
    fit_longest=12288,
    link_bytes=GiB,
)
#: with --full: the frontier's extra modes and the profiler (about 5 minutes)
GPU_FULL = replace(GPU, budgets={**GPU.budgets, "frontier": 150, "losslog": 20})
#: dry: every part, fewer rounds (the H100 model has no noise to average out); the time
#: boxes in wall seconds of the simulated device's Python kernels, on 2 cores
DRY_RUN = Settings(
    budgets={"link": 10, "frontier": 60, "gradients": 15, "shapes": 45, "fit": 60, "losslog": 10},
    rounds=2,
    warmup=1,
    cycles=3,
    fit_step=512,
    fit_longest=12288,
    link_bytes=64 << 20,
)


def run_part(
    report: Report,
    bench: Bench,
    part: str,
    budget: float,
    measure: Callable[[TimeBox], dict[str, Any]],
    judge: Callable[[dict[str, Any]], list[checks.Check]] | None = None,
) -> dict[str, Any]:
    """``measure(box)`` in a time box of ``budget`` seconds, its result kept whatever
    happens (an exception: its traceback's end, and what the part had kept), judged,
    printed and written."""
    report.begin(part)
    print(f"\n== {part} (time box {budget:.0f} s)", flush=True)
    box = TimeBox(report, part, budget)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no-head and deprecation warnings of the modes
            result = measure(box)
    except Exception as e:
        kept = report.payload["parts"].get(part, {})
        result = {**kept, "error": f"{type(e).__name__}: {e}"[:500]}
        result["traceback"] = traceback.format_exc()[-3000:]
        result.pop("partial", None)
        print(result["traceback"])
        bench.cap(None)
        bench.after_oom()
    result["seconds"] = box.seconds()
    result["budget_s"] = budget
    result.setdefault("timed_out", None)
    gc.collect()
    found = judge(result) if judge is not None and "error" not in result else []
    _show(part, result)
    for check in found:
        print(f"  {check}")
    report.end(part, result, checks.as_dicts(found))
    return result


def suite(bench: Bench, report: Report, args: argparse.Namespace, values: Bench) -> None:
    """Every part asked for, in order (see the module doc)."""
    settings = DRY_RUN if bench.sim is not None else GPU_FULL if args.full else GPU
    budgets = {**settings.budgets, **args.budget}
    full = bench.size == FULL
    modes = MODES + (MORE_MODES if args.full else ())
    profiler = profile(bench, bench.ids(bench.size.seq)) if args.full else None
    done: dict[str, dict[str, Any]] = {}

    def measure(box: TimeBox, *, part: str) -> dict[str, Any]:
        if part == "link":
            return link(bench, settings.link_bytes)
        if part == "frontier":
            return frontier(
                bench,
                modes,
                rounds=settings.rounds,
                warmup=settings.warmup,
                box=box,
                profile=profiler,
            )
        if part == "gradients":
            with _values(values):
                return gradients(values, box)
        if part == "shapes":
            return shapes(bench, box, cycles=settings.cycles)
        return fit(bench, box, step=settings.fit_step, longest=settings.fit_longest)

    judges: dict[str, Callable[[dict[str, Any]], list[checks.Check]]] = {
        "link": checks.link_checks,
        "frontier": lambda r: checks.frontier_checks(r, full),
        "gradients": checks.gradient_checks,
        "shapes": lambda r: checks.shape_checks(r, done.get("frontier")),
        "fit": lambda r: checks.fit_checks(r, full),
    }
    for part in PARTS:
        if part in args.parts:
            done[part] = run_part(
                report,
                bench,
                part,
                budgets[part],
                functools.partial(measure, part=part),
                judges[part],
            )
    if args.full:
        run_part(report, bench, "losslog", budgets["losslog"], lambda box: losslog_syncs(bench))
    if args.sanitizer:
        run_part(report, bench, "sanitizer", 150, lambda box: sanitizer(bench, __file__))
    if args.snapshot:
        out_dir = report.path.parent
        run_part(report, bench, "snapshot", 120, lambda box: snapshot(bench, out_dir))


@contextmanager
def _values(bench: Bench) -> Iterator[None]:
    """Values computed for the block (the simulated device is dry otherwise)."""
    if bench.sim is None:
        yield
        return
    bench.sim.dry = False
    try:
        yield
    finally:
        bench.sim.dry = True


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _arguments(argv)
    if args.dry:
        return _dry(args)
    if not torch.cuda.is_available() and args.device is None:
        print("no GPU here: `--dry` runs every part on the simulated H100 (tests/simdev)")
        raise SystemExit(2)
    device = torch.device(args.device or "cuda")
    if device.index is None:
        device = torch.device(device.type, torch.accelerator.current_device_index())
    size = _size(args)
    if args.sanitizer_child:
        sanitizer_child(Bench(device, SANITIZED))
        return {}
    bench = Bench(device, size, pinned=int(args.pinned_gib * GiB))
    return _run(bench, bench, args, RESULTS / "gpu_suite.json")


def _dry(args: argparse.Namespace) -> dict[str, Any]:
    from tests import simdev

    if not simdev.supported():
        print(f"the simulated device needs torch {' or '.join(simdev.device.SUPPORTED)}")
        raise SystemExit(2)
    simdev.register()  # before this process's first backward
    with simdev.enabled() as sim:
        sim.dry = True
        pinned = int(args.pinned_gib * GiB)
        bench = Bench(sim.device, _size(args), pinned=pinned, sim=sim)
        values = Bench(sim.device, VALUES, pinned=pinned, sim=sim)
        return _run(bench, values, args, RESULTS / "gpu_suite_dry.json")


def _run(bench: Bench, values: Bench, args: argparse.Namespace, default: Path) -> dict[str, Any]:
    started = time.perf_counter()
    path = Path(args.json) if args.json else default
    header = {
        "suite": "full" if args.full else "quick",
        "dry": bench.sim is not None,
        "device": str(bench.device),
        "device_name": bench.where(),
        "dtype": str(bench.dtype),
        "size": vars(bench.size),
        "full_size": bench.size == FULL,
        "pinned_budget_per_manager": bench.pinned,
        "versions": _versions(),
    }
    # What is alive now (torch, transformers' Llama, TRL's offloader, leakfree) joins the
    # permanent generation: a full collection (the suite makes one before each pair of
    # steps) then scans only what the suite made, milliseconds instead of a fifth of a
    # second.
    import transformers.models.llama.modeling_llama  # noqa: F401

    trl_missing()
    gc.collect()
    gc.freeze()
    report = Report(path, header)
    print(f"gpu_suite ({header['suite']}) on {header['device_name']}, {bench.size}; JSON: {path}")
    suite(bench, report, args, values)
    report.payload["seconds_total"] = time.perf_counter() - started
    report.write()
    failed = [c for c in report.payload["checks"] if c["verdict"] == "FAIL"]
    print(
        f"\n{len(report.payload['checks'])} checks, {len(failed)} failed; "
        f"{report.payload['seconds_total']:.0f} s in all; wrote {path}"
    )
    return report.payload


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("transformers", "trl", "leakfree"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            out[name] = None
    return out


def _size(args: argparse.Namespace) -> Size:
    size = SMALL if args.small else FULL
    return size.with_(
        **{k: getattr(args, k) for k in ("hidden", "layers", "vocab", "batch", "seq")}
    )


def _budget(text: str) -> tuple[str, float]:
    part, _, seconds = text.partition("=")
    if part not in {*PARTS, "losslog"} or not seconds:
        raise argparse.ArgumentTypeError(
            f"--budget {text}: expected PART=SECONDS, PART one of {', '.join(PARTS)}"
        )
    return part, float(seconds)


def _parts(text: str) -> tuple[str, ...]:
    chosen = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in chosen if p not in PARTS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"--parts {text}: {unknown[0]} is not one of {', '.join(PARTS)}"
        )
    return chosen


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="benchmarks/gpu_suite.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--dry",
        "--tiny",
        action="store_true",
        help="every part on the simulated H100 (tests/simdev), no GPU",
    )
    parser.add_argument(
        "--small", action="store_true", help="2 layers, a quarter of the vocabulary (dry: 20 s)"
    )
    parser.add_argument("--full", action="store_true", help="the old parts too (about 5 min)")
    parser.add_argument("--sanitizer", action="store_true", help="the CUDA Sanitizer, in a child")
    parser.add_argument("--snapshot", action="store_true", help="a memory snapshot, analysed")
    parser.add_argument("--parts", type=_parts, default=PARTS, help="a comma-separated subset")
    parser.add_argument(
        "--budget",
        type=_budget,
        action="append",
        default=[],
        help="a part's time box, PART=SECONDS (repeatable)",
    )
    parser.add_argument(
        "--pinned-gib",
        type=float,
        default=32.0,
        help="each leakfree manager's own pinned host budget",
    )
    parser.add_argument("--device", help="default: cuda")
    parser.add_argument("--json", help="where the JSON goes")
    parser.add_argument("--sanitizer-child", action="store_true", help=argparse.SUPPRESS)
    for key in ("hidden", "layers", "vocab", "batch", "seq"):
        parser.add_argument(
            f"--{key}", type=int, help=f"the model's {key} (default: the full size)"
        )
    args = parser.parse_args(argv)
    args.budget = dict(args.budget)
    return args


# --- the tables each part prints -----------------------------------------------------------


def _show(part: str, result: dict[str, Any]) -> None:
    if result.get("error"):
        print(f"{part}: {result['error']}")
    elif part in _TABLES:
        _TABLES[part](result)
    if result.get("timed_out"):
        print(f"{part}: out of time ({result['budget_s']:.0f} s): {result['timed_out']}")
    print(f"{part}: {result['seconds']:.1f} s")


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _link_table(r: dict[str, Any]) -> None:
    both, beside = r["both_at_once"], r["beside_compute"]
    print_table(
        f"pinned copies, {r['bytes'] >> 20} MiB x {r['repeats']}, GB/s",
        ["direction", "alone", "both at once", "both beside matmuls"],
        [[d, r[f"{d}_alone"], both[d], beside[d]] for d in ("to_host", "to_device")],
    )
    print(
        f"matmul TFLOP/s alone {r['matmul_tflops_alone']:.0f}, beside the copies "
        f"{r['matmul_tflops_beside_copies']:.0f} ({r['matmul']})"
    )


def _frontier_table(r: dict[str, Any]) -> None:
    rows = []
    for mode, m in r["modes"].items():
        if m.get("step_s") is None:
            rows.append([mode, m.get("error") or "-", *["-"] * 6])
            continue
        ratio = m["ratio_vs_none"]
        pvm = m.get("plan_vs_measured") or {}
        plan = (
            " / ".join(_pair(pvm.get(k), k == "overhead") for k in ("overhead", "peak", "held"))
            if pvm
            else "-"
        )
        lower = m["held_lower_than_none"]
        rows.append(
            [
                mode,
                f"{ratio['median']:.2f}x ({ratio['q1']:.2f}-{ratio['q3']:.2f})" if ratio else "-",
                _gib(m["allocated_peak_bytes"]),
                _gib(m["held_peak_bytes"]),
                "-" if lower is None else f"{lower:.0%}",
                _gib(m["to_host_bytes_per_step"]),
                f"{m['step_s']['median'] * 1e3:.1f}",
                plan,
            ]
        )
    print_table(
        f"frontier: {r['rounds_done']} rounds (the first {r['warmup_rounds']} left out); "
        f"device_limit {_gib(r['device_limit'])} GiB; GiB beyond what was allocated before",
        [
            "mode",
            "step vs none (IQR)",
            "allocated",
            "held",
            "held lower",
            "to host",
            "step ms",
            "plan, device totals: overhead / peak / held, predicted -> measured",
        ],
        rows,
    )


def _pair(values: list[Any] | None, fraction: bool) -> str:
    if not values:
        return "-"

    def one(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:.1%}" if fraction else f"{v / GiB:.2f}"

    return f"{one(values[0])} -> {one(values[1])}"


def _gradients_table(r: dict[str, Any]) -> None:
    print_table(
        f"gradients after {r['steps']} steps against none's (deterministic), {r['size']}",
        ["mode", "bit-identical"],
        [[m, row.get("bit_identical", row.get("error"))] for m, row in r["modes"].items()],
    )


def _shapes_table(r: dict[str, Any]) -> None:
    rows = []
    for mode, m in r["modes"].items():
        steps = m.get("steps", [])
        rows.append(
            [
                mode,
                " ".join(f"{s['ratio_vs_none']:.2f}" for s in steps),
                " ".join(_gib(s["held_bytes"]) for s in steps),
                m.get("under_limit_every_step", "-"),
                m.get("error") or "",
            ]
        )
    print_table(
        f"lengths {r['lengths']}: each step against none at its length",
        ["mode", "step vs none", "held GiB", "under its limit", "error"],
        rows,
    )


def _fit_table(r: dict[str, Any]) -> None:
    rows = []
    for mode, m in r["modes"].items():
        tries = " ".join(f"{t['seq']}{'+' if t['trained'] else '-'}" for t in m["tries"])
        per = m.get("us_per_token")
        rows.append([mode, m.get("longest_seq"), "-" if per is None else f"{per:.1f}", tries])
    print_table(
        f"under a cap of {_gib(r['cap_bytes'])} GiB (none's need at the batch x 4096, "
        f"parameters {_gib(r['parameter_bytes'])} GiB): longest sequence, steps of {r['step']}",
        ["mode", "longest", "us/token", "tries (+ trained, - out of memory)"],
        rows,
    )


_TABLES: dict[str, Callable[[dict[str, Any]], None]] = {
    "link": _link_table,
    "frontier": _frontier_table,
    "gradients": _gradients_table,
    "shapes": _shapes_table,
    "fit": _fit_table,
}


if __name__ == "__main__":
    main()
