"""torch.distributed.pipelining across torch releases: does any per-step state grow?

For each torch minor release (2.4 up to the newest), this script makes a scratch venv,
installs ``torch==2.X.*`` there and runs a probe (this same file with ``--probe``: pure
torch, no leakfree) with 2 gloo ranks on 127.0.0.1. The probe trains a 2-stage MLP with
``ScheduleGPipe`` and ``Schedule1F1B`` (4 microbatches, 20 steps, SGD) in four modes:

* ``none``: ``schedule.step(...)`` without ``losses=``;
* ``list``: ``losses=held`` with the same plain list passed every step;
* ``detaching``: ``losses=`` a list subclass whose ``append`` / ``extend`` / ``insert`` /
  item assignment store ``t.detach()`` (what ``leakfree.pipeline.PipelineLosses`` does);
* ``detaching+clear``: the same, and ``stage.clear_runtime_states()`` (public: the reset
  each step begins with) called after each step.

After every step (after ``optimizer.step()`` and ``zero_grad(set_to_none=True)``) it records
(the gc walk only after steps 1, 2, every 5th and the last: it costs ~1 s):

* receive buffers: leaf tensors that require grad and are not parameters (found by a gc
  walk: public API only), how many, and how many still have ``.grad`` set. As a cross-check
  it also reads the stage's own receive-buffer table (``args_recv_info``: a PRIVATE
  attribute, read here only because this is a measurement script; leakfree never does);
* live tensor bytes: every tensor the garbage collector can see, distinct storages summed;
* gc-tracked objects (any other per-step growth: Python objects, autograd nodes' owners);
* the returned losses: how many are in ``held``, how many carry ``grad_fn``, and how many
  of the tensors that a custom ``Function`` on the last stage parks on ``ctx`` (64 KiB per
  microbatch, as Transformer Engine does) are still alive: a graph kept by a loss keeps
  them;
* gradients: each stage's parameter gradients against the same model run in one process
  (microbatch by microbatch, same order), compared with ``torch.equal`` every step.

Growth is step 20 minus step 2 (the first steps allocate the buffers and warm caches).

A second pass per release (skip it with ``--no-repair``) measures leakfree's repair of
the stages (``patch_all()``, docs/pipeline.md): this checkout's ``leakfree`` and
``tests/_pipelining.py`` run in the same venv (with ``wrapt`` and ``packaging``), 2 gloo
ranks, GPipe and 1F1B, 4 steps, three ways: unpatched, ``patch_all()`` (which applies on
the releases the repair was measured on) and ``patch_all(torch_pipelining="always")``
(the code gates alone decide): hook fires per step on the stage inputs, receive-buffer
bytes between steps, sent outputs alive, and the gradients against unpatched and one
process.

    python benchmarks/pipeline_versions.py [--versions 2.4,2.13] [--venv-root DIR] [--keep]
        [--steps 20] [--schedules ScheduleGPipe,Schedule1F1B] [--probe-timeout 240]
        [--static-shapes] [--json PATH]
    python benchmarks/pipeline_versions.py --from-partial ROOT1/partial.json,...

Each schedule runs in its own pair of processes, killed after ``--probe-timeout`` seconds
if it hangs (the table says where each rank was). ``--from-partial`` reports earlier runs
(e.g. parallel ones, one ``--venv-root`` each) without measuring.

Venvs go under ``--venv-root`` (default /work/scratch/pipeline-venvs) and are deleted
after use unless ``--keep``; each CUDA build of torch is ~3 GB installed.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from pathlib import Path
from typing import Any

VERSIONS = [f"2.{m}" for m in range(4, 15)]
DEFAULT_ROOT = "/work/scratch/pipeline-venvs"
HERE = Path(__file__).resolve()

# --------------------------------------------------------------------------- probe
# Everything below until the driver runs inside the scratch venv: torch only.

N_MB = 4
BATCH = 16
DIM = 64
HIDDEN = 256
CTX_BYTES = 64 * 1024


def _model_parts() -> tuple[Any, Any]:
    import torch
    from torch import nn

    stash: list[Any] = []

    class Tag(torch.autograd.Function):
        """Identity that parks a 64 KiB tensor on ctx, as some libraries' Functions do:
        backward does not free ctx attributes, only the graph's death does."""

        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            ctx.extra = torch.empty(CTX_BYTES // 4)
            stash.append(weakref.ref(ctx.extra))
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return g

    class Tagged(nn.Module):
        def forward(self, x: Any) -> Any:
            return Tag.apply(x)

    torch.manual_seed(0)
    full = nn.Sequential(
        nn.Linear(DIM, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, DIM),
        Tagged(),
        nn.Linear(DIM, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, DIM),
    )
    return full, stash


def _batch(step: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)


class _Detaching(list):  # type: ignore[type-arg]
    """A list that stores only detached tensors, by every path torch's schedules use."""

    def append(self, v: Any) -> None:
        super().append(v.detach() if hasattr(v, "detach") else v)

    def extend(self, vs: Any) -> None:
        super().extend(v.detach() if hasattr(v, "detach") else v for v in vs)

    def insert(self, i: Any, v: Any) -> None:
        super().insert(i, v.detach() if hasattr(v, "detach") else v)

    def __setitem__(self, i: Any, v: Any) -> None:
        if isinstance(i, slice):
            v = [x.detach() if hasattr(x, "detach") else x for x in v]
        elif hasattr(v, "detach"):
            v = v.detach()
        super().__setitem__(i, v)

    def __iadd__(self, vs: Any) -> _Detaching:
        self.extend(vs)
        return self


def _live_tensors() -> tuple[int, int, list[Any], int]:
    """(bytes of distinct storages, tensor count, non-parameter requiring-grad leaves,
    gc-tracked objects)."""
    import torch

    gc.collect()
    seen: dict[Any, int] = {}
    count = 0
    leaves = []
    objects = gc.get_objects()
    for obj in objects:
        # type(), not isinstance(): isinstance reads obj.__class__, which on some
        # deprecated objects (torch.distributed.reduce_op) emits a warning per call.
        if not issubclass(type(obj), torch.Tensor):
            continue
        count += 1
        try:
            st = obj.untyped_storage()
            seen[(st.data_ptr(), obj.device)] = st.nbytes()
        except Exception:
            pass
        if obj.requires_grad and obj.is_leaf and not isinstance(obj, torch.nn.Parameter):
            leaves.append(obj)
    n = len(objects)
    del objects
    return sum(seen.values()), count, leaves, n


def _private_recv_buffers(stage: Any) -> list[Any] | None:
    """PRIVATE: the stage's receive buffers from ``args_recv_info`` (measurement only)."""
    import torch

    table = getattr(stage, "args_recv_info", None)
    if not isinstance(table, dict):
        return None
    out = []
    for infos in table.values():
        for info in infos if isinstance(infos, (tuple, list)) else (infos,):
            buf = getattr(info, "buffer", None)
            if isinstance(buf, torch.Tensor):
                out.append(buf)
    return out


STATIC_ENV = "PIPELINE_PROBE_STATIC_SHAPES"


def _make_stage(rank: int, part: Any, x_mb: Any) -> Any:
    import torch
    from torch.distributed.pipelining import PipelineStage

    params = inspect.signature(PipelineStage.__init__).parameters
    kw: dict[str, Any] = {}
    arg = params.get("input_args")
    static = os.environ.get(STATIC_ENV) == "1"
    if arg is not None and (static or arg.default is inspect.Parameter.empty):
        # Older releases need example inputs/outputs (no shape inference yet); with
        # --static-shapes every release gets them.
        example_in = x_mb if rank == 0 else torch.empty(x_mb.shape[0], DIM)
        kw["input_args"] = (example_in,)
        if "output_args" in params:
            kw["output_args"] = (torch.empty(x_mb.shape[0], DIM),)
    return PipelineStage(part, rank, 2, torch.device("cpu"), **kw), sorted(kw)


def _make_schedule(name: str, stage: Any, loss_fn: Any) -> Any:
    from torch.distributed import pipelining

    cls = getattr(pipelining, name)
    return cls(stage, n_microbatches=N_MB, loss_fn=loss_fn)


def _reference_grads(full: Any, x: Any, y: Any, loss_fn: Any) -> list[Any]:
    """The same model in one process, microbatch by microbatch: summed gradients."""
    full.zero_grad(set_to_none=True)
    for xm, ym in zip(x.tensor_split(N_MB), y.tensor_split(N_MB)):
        loss_fn(full(xm), ym).backward()
    return [p.grad.clone() for p in full.parameters()]


ROW_KEYS = (
    "step",
    "live_bytes",
    "tensors",
    "gc_objects",
    "recv_leaves",
    "recv_leaves_grad_set",
    "private_recv_buffers",
    "private_recv_grad_set",
    "held_losses",
    "held_with_grad_fn",
    "ctx_tensors_alive",
    "grads_equal",
)


def _run_one(rank: int, sched_name: str, mode: str, steps: int, progress: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    full, stash = _model_parts()
    ref, ref_stash = _model_parts()
    split = 3
    part = full[:split] if rank == 0 else full[split:]
    n_ref_part = len(list(ref[:split].parameters()))
    opt = torch.optim.SGD(part.parameters(), lr=0.01)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.01)
    loss_fn = torch.nn.functional.mse_loss

    x0, _ = _batch(0)
    stage, stage_kw = _make_stage(rank, part, x0.tensor_split(N_MB)[0])
    schedule = _make_schedule(sched_name, stage, loss_fn)
    held: list[Any] = [] if mode == "list" else _Detaching()
    # Filled in place (ints, bools and None are not gc-tracked), so the probe's own
    # bookkeeping adds no gc objects across steps.
    rows = [dict.fromkeys(ROW_KEYS) for _ in range(steps)]
    grads_equal = True
    grad_scale = None
    for step in range(1, steps + 1):
        x, y = _batch(step)
        stash.clear()
        ref_stash.clear()
        kw: dict[str, Any] = {}
        if rank == 1:
            kw["target"] = y
            if mode != "none":
                kw["losses"] = held
        if rank == 0:
            schedule.step(x, **kw)
        else:
            schedule.step(**kw)
        # Reference: one process, same data; torch may divide by n_microbatches at the end.
        ref_grads = _reference_grads(ref, x, y, loss_fn)
        mine = [p.grad for p in part.parameters()]
        theirs = ref_grads[:n_ref_part] if rank == 0 else ref_grads[n_ref_part:]
        if grad_scale is None:
            grad_scale = "sum" if all(torch.equal(a, b) for a, b in zip(mine, theirs)) else "mean"
        if grad_scale == "mean":
            for p in ref.parameters():
                p.grad.div_(N_MB)
            theirs = [p.grad for p in ref.parameters()]
            theirs = theirs[:n_ref_part] if rank == 0 else theirs[n_ref_part:]
        equal = all(a is not None and torch.equal(a, b) for a, b in zip(mine, theirs))
        grads_equal = grads_equal and equal
        opt.step()
        opt_ref.step()
        opt.zero_grad(set_to_none=True)
        opt_ref.zero_grad(set_to_none=True)
        if mode == "detaching+clear":
            # The stage's public reset (what each step begins with), called after the step.
            stage.clear_runtime_states()
        # The gc walk costs ~1 s on a loaded machine: take it at steps 1, 2, every 5th and
        # the last (growth is last minus step 2); the other counters are read every step.
        walked = step in (1, 2, steps) or step % 5 == 0
        live, count, leaves, objects = _live_tensors() if walked else (None, None, [], None)
        private = _private_recv_buffers(stage)
        rows[step - 1].update(
            {
                "step": step,
                "live_bytes": live,
                "tensors": count,
                "gc_objects": objects,
                "recv_leaves": len(leaves) if walked else None,
                "recv_leaves_grad_set": sum(t.grad is not None for t in leaves) if walked else None,
                "private_recv_buffers": None if private is None else len(private),
                "private_recv_grad_set": (
                    None if private is None else sum(b.grad is not None for b in private)
                ),
                "held_losses": len(held) if rank == 1 and mode != "none" else None,
                "held_with_grad_fn": (
                    sum(getattr(t, "grad_fn", None) is not None for t in held)
                    if rank == 1 and mode != "none"
                    else None
                ),
                "ctx_tensors_alive": sum(r() is not None for r in stash) if rank == 1 else None,
                "grads_equal": equal,
            }
        )
        del leaves, private
        progress(mode, step)
    dist.barrier()
    first, last = rows[1], rows[-1]
    return {
        "schedule": sched_name,
        "losses": mode,
        "stage_kwargs": stage_kw,
        "grad_scale": grad_scale,
        "grads_equal_all_steps": grads_equal,
        "growth_bytes": last["live_bytes"] - first["live_bytes"],
        "growth_tensors": last["tensors"] - first["tensors"],
        "growth_gc_objects": last["gc_objects"] - first["gc_objects"],
        "steps": rows,
    }


def _probe_rank(rank: int, port: int, steps: int, out: str, schedule: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    caught: set[str] = set()
    count = [0]

    def record(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        # A set and a counter, not a growing list: the probe must not grow per step.
        caught.add(f"{category.__name__}: {message}")
        count[0] += 1

    result: dict[str, Any] = {"rank": rank, "torch": torch.__version__, "runs": []}

    def progress(mode: str, step: int) -> None:
        # Written as it goes: a run that hangs still says how far it got.
        result["at"] = {"losses": mode, "step": step}
        result["warnings"] = sorted(caught)
        result["warning_count"] = count[0]
        Path(out).write_text(json.dumps(result))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
        try:
            for mode in MODES:
                progress(mode, 0)
                try:
                    result["runs"].append(_run_one(rank, schedule, mode, steps, progress))
                except Exception:
                    result["runs"].append(
                        {"schedule": schedule, "losses": mode, "error": traceback.format_exc()}
                    )
                    raise
        finally:
            result.pop("at", None)
            result["warnings"] = sorted(caught)
            result["warning_count"] = count[0]
            Path(out).write_text(json.dumps(result))
            dist.destroy_process_group()


MODES = ("none", "list", "detaching", "detaching+clear")
SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")


def probe(steps: int, out: str, schedule: str, timeout: float) -> int:
    """Run both ranks (two processes) of one schedule; write the merged result to ``out``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = Path(tempfile.mkdtemp())
    procs = [
        subprocess.Popen(
            [
                *(sys.executable, str(HERE), "--probe-rank", str(r), "--port", str(port)),
                *("--steps", str(steps), "--json", str(tmp / f"rank{r}.json")),
                *("--schedule", schedule),
            ]
        )
        for r in range(2)
    ]
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append("timeout")
    ranks = []
    for r in range(2):
        f = tmp / f"rank{r}.json"
        ranks.append(json.loads(f.read_text()) if f.exists() else None)
    Path(out).write_text(json.dumps({"exit_codes": codes, "timeout_s": timeout, "ranks": ranks}))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0 if codes == [0, 0] else 1


# --------------------------------------------------------------------------- driver


# --------------------------------------------------------------------------- repair probe
# Runs inside the scratch venv too, with this checkout on sys.path (leakfree and the tests'
# harness: tests/_pipelining.py, the integration tests' runs) and wrapt + packaging installed.

REPAIR_STEPS = 4


def _repair_worker(rank: int, world: int, schedules: list[str]) -> dict[str, Any]:
    import leakfree
    from tests import _pipelining as P

    out: dict[str, Any] = {}
    for schedule in schedules:
        runs = {}
        modes = (("unpatched", None), ("patched", {}), ("forced", {"torch_pipelining": "always"}))
        for mode, patch in modes:
            r = P.run(P.Config(schedule, patch=patch, steps=REPAIR_STEPS, dim=64), rank, world)
            runs[mode] = {
                "hook_fires": r.hook_fires,
                "recv_between": r.recv_bytes_between,
                "sent_peak": r.sent_alive_peak,
                "sent_at_first_backward": r.sent_alive_at_first_backward,
                "live": r.live_bytes,
                "grads": r.grads,
                "grads_equal_reference": r.grads_equal_reference,
            }
        for key, options in (("report", {}), ("forced_report", {"torch_pipelining": "always"})):
            report = leakfree.patch_all(**options)
            runs[key] = {
                x.name: ": ".join(str(w) for w in (x.outcome, x.reason, x.detail) if w)
                for x in report
                if x.integration == "torch_pipelining"
            }
            leakfree.unpatch_all()
        leakfree.unpatch_all()
        out[schedule] = runs
    return out


def repair_probe(out: str, schedules: list[str]) -> int:
    """Unpatched and patched runs of each schedule on 2 gloo ranks; JSON to ``out``."""
    root = str(HERE.parents[1])
    sys.path.insert(0, root)
    import torch.distributed.pipelining  # noqa: F401  (before patch_all: applied at once)

    from tests._dist import run_workers

    try:
        with tempfile.TemporaryDirectory() as tmp:
            ranks = run_workers(_repair_worker, 2, Path(tmp), schedules, timeout=600)
        Path(out).write_text(json.dumps({"ranks": ranks}))
    except Exception as e:  # a release the harness cannot drive: say why
        Path(out).write_text(json.dumps({"error": f"{type(e).__name__}: {e}"[:500]}))
    return 0


def repair_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    """One row per (torch release, schedule): what the repair changes there."""
    rows = []
    for entry in results:
        repair = entry.get("repair")
        if not repair:
            continue
        label = entry.get("torch") or entry["requested"]
        if "error" in repair:
            rows.append([label, "-", repair["error"][:200], "", "", "", ""])
            continue
        first, last = repair["ranks"]
        for schedule in SCHEDULES:
            if schedule not in last:
                continue
            forced = "forced" in last[schedule]
            a, b = (last[schedule][m] for m in ("unpatched", "forced" if forced else "patched"))
            fa, fb = (first[schedule][m] for m in ("unpatched", "forced" if forced else "patched"))
            statuses = _statuses(last[schedule]["report"])
            forced_statuses = _statuses(last[schedule].get("forced_report", {}))
            sent = "sent_at_first_backward" if schedule == "ScheduleGPipe" else "sent_peak"
            same = all(
                x["grads"] == y["grads"] and all(y["grads_equal_reference"])
                for x, y in ((a, b), (fa, fb))
            )
            rows.append(
                [
                    label,
                    schedule.replace("Schedule", ""),
                    statuses
                    + (
                        f"; 'always': {forced_statuses}"
                        if forced and forced_statuses != statuses
                        else ""
                    )
                    + ("; 'always': the same" if forced and forced_statuses == statuses else ""),
                    f"{a['hook_fires'][1:]} / {b['hook_fires'][1:]}",
                    f"{fa['recv_between'][-1] + a['recv_between'][-1]} / "
                    f"{fb['recv_between'][-1] + b['recv_between'][-1]}",
                    f"{max(fa[sent][1:])} / {max(fb[sent][1:])}",
                    "yes" if same else "NO",
                ]
            )
    return rows


def _statuses(report: dict[str, str]) -> str:
    """``applied: sent_outputs, step_state; skipped: stage_inputs`` from a report (each
    value ``outcome: reason: detail``)."""
    by: dict[str, list[str]] = {}
    for name, text in report.items():
        by.setdefault(text.split(":")[0], []).append(name.split(".", 1)[1])
    return "; ".join(f"{status}: {', '.join(names)}" for status, names in sorted(by.items()))


REPAIR_HEADER = [
    "torch",
    "schedule",
    "patch_all() here; with torch_pipelining='always'",
    "hook fires per step, steps 2-4 (last rank): unpatched / 'always'",
    "receive-buffer bytes between steps (both ranks): unpatched / 'always'",
    "rank 0 sent outputs alive (GPipe: at the first backward; 1F1B: peak): unpatched / 'always'",
    "gradients: 'always' == unpatched == 1 process",
]


def _run(cmd: list[str], log: Path, timeout: float) -> int:
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        try:
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
            return done.returncode
        except subprocess.TimeoutExpired:
            f.write(f"timed out after {timeout} s\n")
            return 124


def measure_version(
    version: str,
    root: Path,
    steps: int,
    keep: bool,
    timeout: float,
    schedules: tuple[str, ...] = SCHEDULES,
    repair: bool = True,
) -> dict[str, Any]:
    venv = root / f"torch-{version}"
    log = root / f"torch-{version}.log"
    log.write_text("")
    t0 = time.monotonic()
    entry: dict[str, Any] = {"requested": version, "probes": {}}
    if os.environ.get(STATIC_ENV) == "1":
        entry["requested"] = f"{version} static"  # reported as its own row
        entry["static_shapes"] = True
    try:
        made = (venv / "bin" / "python").exists()
        if not made and _run([sys.executable, "-m", "venv", str(venv)], log, 300):
            entry["error"] = "venv creation failed"
            return entry
        py = str(venv / "bin" / "python")
        code = _run(
            [py, "-m", "pip", "install", "--no-cache-dir", "-q", f"torch=={version}.*", "numpy"],
            log,
            1800,
        )
        if code:
            tail = [ln for ln in log.read_text().splitlines() if "ERROR" in ln][-2:]
            entry["error"] = "install failed: " + " | ".join(tail or ["see the log"])
            return entry
        entry["install_s"] = round(time.monotonic() - t0, 1)
        for schedule in schedules:
            out = root / f"torch-{version}-{schedule}.json"
            out.unlink(missing_ok=True)
            cmd = [py, str(HERE), "--probe", "--steps", str(steps), "--json", str(out)]
            cmd += ["--schedule", schedule, "--probe-timeout", str(timeout)]
            _run(cmd, log, timeout + 120)
            entry["probes"][schedule] = json.loads(out.read_text()) if out.exists() else {}
        if repair:
            out = root / f"torch-{version}-repair.json"
            out.unlink(missing_ok=True)
            code = _run([py, "-m", "pip", "install", "-q", "wrapt", "packaging"], log, 600)
            cmd = [py, str(HERE), "--repair-probe", "--json", str(out)]
            cmd += ["--schedules", ",".join(schedules)]
            if not code:
                _run(cmd, log, 900)
            entry["repair"] = (
                json.loads(out.read_text()) if out.exists() else {"error": "see the log"}
            )
            version_out = subprocess.run(
                [py, "-c", "import torch; print(torch.__version__)"],
                capture_output=True,
                text=True,
            )
            entry["torch"] = version_out.stdout.strip() or None
    finally:
        entry["wall_s"] = round(time.monotonic() - t0, 1)
        if not keep:
            shutil.rmtree(venv, ignore_errors=True)
    return entry


def _failure(result: dict[str, Any]) -> str:
    """Why a probe gave no full result: a hang (where each rank was) or an error."""
    codes = result.get("exit_codes")
    ranks = result.get("ranks") or [None, None]
    if codes and "timeout" in codes:
        # The peer's "connection closed" error is the kill's doing: not reported.
        where = [
            f"rank {r} in step {at['step'] + 1} (losses={at['losses']})"
            for r, data in enumerate(ranks)
            if (at := (data or {}).get("at"))
        ]
        limit = result.get("timeout_s")
        return f"hangs: {'; '.join(where) or 'no rank started'} (killed after {limit} s)"
    killed = []
    for r, c in enumerate(codes or []):
        if isinstance(c, int) and c < 0:
            at = (ranks[r] or {}).get("at") or {"step": 0}
            killed.append(f"rank {r} aborted (signal {-c}) in step {at['step'] + 1}")
    if killed:  # the peer's "connection reset" is the abort's doing: not reported
        return "crashes: " + "; ".join(killed) + " (message in the log under `--venv-root`)"
    errors = [
        f"rank {r}: " + run["error"].strip().splitlines()[-1][:120]
        for r, data in enumerate(ranks)
        for run in (data or {}).get("runs", [])
        if "error" in run
    ]
    return f"exit {codes}: " + "; ".join(errors)


def summarize(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (schedule, losses mode), or one row per schedule that failed."""
    out = []
    for schedule, result in entry.get("probes", {}).items():
        ranks = result.get("ranks") or []
        runs = {}
        if len(ranks) == 2 and all(ranks):
            for a, b in zip(ranks[0]["runs"], ranks[1]["runs"]):
                if "error" not in a and "error" not in b:
                    runs[a["losses"]] = (a, b)
        torch_version = next((r["torch"] for r in ranks if r), entry["requested"])
        finished = result.get("exit_codes") == [0, 0]
        for mode in MODES:
            if mode not in runs and finished:
                continue  # a probe from before that mode existed: not measured
            if mode not in runs:
                out.append(
                    {
                        "torch": torch_version,
                        "schedule": schedule,
                        "losses": mode,
                        "failure": _failure(result),
                    }
                )
                continue
            a, b = runs[mode]
            steps = a["steps"] + b["steps"]
            last1 = b["steps"][-1]
            out.append(
                {
                    "torch": torch_version,
                    "schedule": schedule,
                    "losses": mode,
                    "grads_equal": a["grads_equal_all_steps"] and b["grads_equal_all_steps"],
                    "grad_scale": b["grad_scale"],
                    "stage_kwargs": b["stage_kwargs"],
                    "recv_buffers": last1["recv_leaves"],
                    "recv_grad_set": max(s["recv_leaves_grad_set"] or 0 for s in steps),
                    "private_recv_buffers": last1["private_recv_buffers"],
                    "private_recv_grad_set": max(s["private_recv_grad_set"] or 0 for s in steps),
                    "held": last1["held_losses"],
                    "held_grad_fn": last1["held_with_grad_fn"],
                    "ctx_alive": last1["ctx_tensors_alive"],
                    "growth_bytes": max(a["growth_bytes"], b["growth_bytes"]),
                    "growth_tensors": max(a["growth_tensors"], b["growth_tensors"]),
                    "growth_gc_objects": max(a["growth_gc_objects"], b["growth_gc_objects"]),
                    "live_bytes_last_stage": last1["live_bytes"],
                    "warnings": sum(r["warning_count"] for r in ranks),
                }
            )
    return out


HEADER = [
    "torch",
    "schedule",
    "grads == 1 process",
    "growth, steps 2 to 20",
    "receive buffers, .grad set after step",
    "microbatch graphs alive after step: no losses= / plain list / detaching / + clear",
    "plain list: losses with graph",
]


def _growth(rows: list[dict[str, Any]]) -> str:
    worst = max(rows, key=lambda s: (s["growth_bytes"], s["growth_gc_objects"]))
    if not any(s["growth_bytes"] or s["growth_tensors"] or s["growth_gc_objects"] for s in rows):
        return "none (0 B, 0 tensors, 0 objects)"
    return (
        f"{worst['growth_bytes']} B, {worst['growth_tensors']} tensors, "
        f"{worst['growth_gc_objects']} objects ({worst['losses']})"
    )


def _label(entry: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    static = " (input_args / output_args given)" if entry.get("static_shapes") else ""
    return f"{rows[0]['torch']}{static}"


def table_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    """One row per (torch release, schedule); the four loss modes side by side."""
    rows = []
    for entry in results:
        summ = summarize(entry)
        if not summ:
            why = entry.get("error", "no result")
            rows.append([entry["requested"], "-", why[:200], "", "", "", ""])
            continue
        for schedule in SCHEDULES:
            mine = [s for s in summ if s["schedule"] == schedule]
            if not mine:
                continue
            name = schedule.replace("Schedule", "")
            failed = [s for s in mine if "failure" in s]
            if failed:
                rows.append([_label(entry, mine), name, failed[0]["failure"][:200], "", "", "", ""])
                continue
            by = {s["losses"]: s for s in mine}
            alive = " / ".join(str(by[m]["ctx_alive"]) if m in by else "-" for m in MODES)
            plain = by.get("list")
            rows.append(
                [
                    _label(entry, mine),
                    name,
                    "yes" if all(s["grads_equal"] for s in mine) else "NO",
                    _growth(mine),
                    " / ".join(
                        f"{by[m]['recv_grad_set']} of {by[m]['recv_buffers']}" if m in by else "-"
                        for m in MODES
                    ),
                    alive,
                    "-" if plain is None else f"{plain['held_grad_fn']} of {plain['held']}",
                ]
            )
    return rows


def markdown(rows: list[list[str]], header: list[str] | None = None) -> str:
    header = HEADER if header is None else header
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _columns(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The raw results with each run's per-step rows as one list per counter (compact)."""
    out = json.loads(json.dumps(results))
    for entry in out:
        for probe_result in entry.get("probes", {}).values():
            for rank in probe_result.get("ranks") or []:
                for run in (rank or {}).get("runs", []):
                    steps = run.pop("steps", None)
                    if steps:
                        run["per_step"] = {k: [row[k] for row in steps] for k in steps[0]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--versions", default=",".join(VERSIONS), help="e.g. 2.4,2.13")
    ap.add_argument("--venv-root", default=DEFAULT_ROOT)
    ap.add_argument("--keep", action="store_true", help="keep each venv after use")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--probe-timeout", type=float, default=240.0, help="seconds per schedule")
    ap.add_argument("--json", default=None)
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="which schedules to run")
    ap.add_argument(
        "--static-shapes",
        action="store_true",
        help="give every PipelineStage input_args / output_args (no shape inference)",
    )
    ap.add_argument(
        "--from-partial",
        default=None,
        help="comma-separated partial.json files of earlier (e.g. parallel) runs: "
        "report them, measure nothing",
    )
    ap.add_argument(
        "--no-repair",
        action="store_true",
        help="skip the second pass: unpatched vs leakfree.patch_all() on each release",
    )
    ap.add_argument("--repair-probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--probe-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--schedule", choices=SCHEDULES, default=SCHEDULES[0], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps < 3:
        ap.error("--steps must be at least 3 (growth is measured from step 2)")
    if args.probe_rank is not None:
        _probe_rank(args.probe_rank, args.port, args.steps, args.json, args.schedule)
        return 0
    if args.probe:
        return probe(args.steps, args.json, args.schedule, args.probe_timeout)
    if args.repair_probe:
        return repair_probe(args.json, [x for x in args.schedules.split(",") if x])

    sys.path.insert(0, str(HERE.parent))
    from _common import environment, print_table, write_json

    versions = [v.strip() for v in args.versions.split(",") if v.strip()]
    schedules = tuple(x.strip() for x in args.schedules.split(",") if x.strip())
    if not schedules or set(schedules) - set(SCHEDULES):
        ap.error(f"--schedules: choose from {', '.join(SCHEDULES)}, got {args.schedules!r}")
    bad = [v for v in versions if not v.startswith("2.") or not v[2:].isdigit()]
    if bad:
        ap.error(f"--versions: expected minor releases like 2.4, got {bad}")
    results = []
    if args.from_partial:
        merged: dict[str, dict[str, Any]] = {}
        for f in args.from_partial.split(","):
            for e in json.loads(Path(f).read_text()):
                # A later file's schedules replace an earlier one's (a rerun of one schedule).
                have = merged.setdefault(e["requested"], e)
                if have is not e:
                    have["probes"].update(e.get("probes", {}))
                    for key in ("repair", "torch"):  # the repair pass: the later run's
                        if key in e:
                            have[key] = e[key]
        order = {v: i for i, v in enumerate(VERSIONS)}

        def key(e: dict[str, Any]) -> tuple[int, str]:
            v = e["requested"].split()[0]
            return order.get(v, len(order)), e["requested"]

        results = sorted(merged.values(), key=key)
        versions = []
    if args.static_shapes:
        os.environ[STATIC_ENV] = "1"  # read by the probes, which inherit it
    root = Path(args.venv_root)
    root.mkdir(parents=True, exist_ok=True)
    for v in versions:
        print(f"torch {v}: installing and probing ...", flush=True)
        entry = measure_version(
            v, root, args.steps, args.keep, args.probe_timeout, schedules, not args.no_repair
        )
        print(f"torch {v}: {entry.get('error', 'done')} ({entry['wall_s']} s)", flush=True)
        results.append(entry)
        # Written after each version, so a long run leaves what it measured so far.
        (root / "partial.json").write_text(json.dumps(results))
    rows = table_rows(results)
    print_table("torch.distributed.pipelining across torch releases", HEADER, rows)
    fixed = repair_rows(results)
    if fixed:
        print_table("the repair (leakfree.patch_all()), release by release", REPAIR_HEADER, fixed)
    payload = {
        "environment": environment(),
        "command": "python benchmarks/pipeline_versions.py " + " ".join(sys.argv[1:]),
        "steps": args.steps,
        "microbatches": N_MB,
        "summary": [dict(s, requested=e["requested"]) for e in results for s in summarize(e)],
        "errors": {e["requested"]: e["error"] for e in results if "error" in e},
        "warnings": {
            e["requested"]: sorted(
                {
                    w
                    for p in e.get("probes", {}).values()
                    for r in p.get("ranks") or []
                    if r
                    for w in r.get("warnings", [])
                }
            )
            for e in results
        },
        "markdown": markdown(rows),
        "repair": {e["requested"]: e["repair"] for e in results if "repair" in e},
        "repair_markdown": markdown(fixed, REPAIR_HEADER),
    }
    path = write_json("pipeline_versions", payload, args.json)
    # Every step of every run, compact, beside it (an indented copy would be ~1 MB).
    raw = path.with_name(path.stem + ".raw.json")
    raw.write_text(json.dumps(_columns(results), separators=(",", ":")) + "\n")
    print(f"\nmarkdown table:\n\n{payload['markdown']}\n\n{payload['repair_markdown']}")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
