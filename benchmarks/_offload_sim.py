"""Offloaders side by side on the simulated accelerator (``tests/simdev``), for offload.py.

The simulated device (device type ``sim``) keeps its tensors in host memory and runs each
aten op as a Python kernel (5-40 us); streams and events are bookkeeping. Step times
are therefore dominated by op count, not by bytes: they say what an offloader costs in
Python and in extra ops, not what a GPU's copy engines would do. Copies, saved tensors,
Python calls, device bytes and gradients are exact.

Each mode runs on its own deep copy of one seeded model (TRL's and leakfree's helpers
register hooks on the model they are given), with the same inputs, made on the device
before any counter is reset. A step is one forward and one backward, never an optimizer
step, so every copy keeps the same weights throughout.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _common import Timings, compare, print_table
from torch import nn

import leakfree

MODES = (
    "none",
    "save_on_cpu",
    "trl class",
    "trl manager",
    "leakfree",
    "leakfree budget",
    "leakfree keep-all",
)
KEEP_ALL = 10**12  #: a device budget that keeps every activation on the device


@dataclass
class Workload:
    """A model and the loss of one forward on inputs already on the device."""

    title: str  #: what a step is, for the table's title
    model: nn.Module  #: seeded, on the device; every mode runs a deep copy
    loss: Callable[[nn.Module], torch.Tensor]
    has_head: bool  #: whether TRL's and leakfree's head discovery finds an output head


@dataclass
class Run:
    """One mode on its own copy of the workload's model."""

    mode: str
    model: nn.Module
    context: Callable[[], Any]  #: the context of one step (new, or the one made once)
    loss: Callable[[nn.Module], torch.Tensor]  #: the workload's
    made_once: Any = None  #: leakfree's context, for its statistics


@dataclass
class Setup:
    """The runs of one workload, the modes that could not run and why, and the budget."""

    runs: dict[str, Run] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    leakfree_moved_bytes: int | None = None
    budget: int | None = None


class NotAvailable(Exception):
    """A mode that cannot run here (not installed, keyword missing); the message says why."""


# --- modes --------------------------------------------------------------------------------


def make_run(mode: str, work: Workload, budget: int | None) -> Run:
    """Mode ``mode`` on a deep copy of ``work.model``; raises NotAvailable with the reason."""
    model = copy.deepcopy(work.model)
    if mode == "none":
        return Run(mode, model, contextlib.nullcontext, work.loss)
    if mode == "save_on_cpu":
        soc = torch.autograd.graph.save_on_cpu
        return Run(mode, model, lambda: soc(pin_memory=True), work.loss)
    if mode.startswith("trl"):
        try:
            from trl.models import activation_offloading as trl_offload
        except Exception as e:
            raise NotAvailable(f"trl not importable ({type(e).__name__})") from None
        if mode == "trl class":  # a new one each step, as TRL's own usage
            return Run(mode, model, trl_offload.OffloadActivations, work.loss)
        ctx = trl_offload.get_act_offloading_ctx_manager(model, warn_if_no_head=work.has_head)
        return Run(mode, model, lambda: ctx, work.loss)
    kwargs: dict[str, Any] = {"warn_if_no_head": work.has_head}
    if mode != "leakfree":
        if "device_budget" not in inspect.signature(leakfree.OffloadActivations).parameters:
            raise NotAvailable("OffloadActivations has no device_budget keyword")
        if mode == "leakfree budget" and budget is None:
            raise NotAvailable("no budget: the leakfree mode did not run")
        kwargs["device_budget"] = KEEP_ALL if mode == "leakfree keep-all" else budget
    ctx = leakfree.offload_model(model, **kwargs)
    return Run(mode, model, lambda: ctx, work.loss, made_once=ctx)


def step(run: Run) -> None:
    """One forward under the mode's context and one backward."""
    with run.context():
        loss = run.loss(run.model)
    loss.backward()


def setup(work: Workload) -> Setup:
    """Every mode on its own deep copy of ``work.model``, each run once to see that it runs.
    The budget mode's budget is half the bytes the plain leakfree mode moves per step."""
    out = Setup()
    for mode in MODES:
        if mode == "leakfree budget" and "leakfree" in out.runs:
            out.leakfree_moved_bytes = moved_bytes_per_step(out.runs["leakfree"])
            out.budget = out.leakfree_moved_bytes // 2
        try:
            run = make_run(mode, work, out.budget)
            step(run)
        except Exception as e:
            reason = str(e) if isinstance(e, NotAvailable) else f"{type(e).__name__}: {e}"
            out.unavailable[mode] = reason[:120]
            continue
        out.runs[mode] = run
    return out


def teardown(s: Setup) -> None:
    """Remove the hooks leakfree's modes registered on their copies."""
    for run in s.runs.values():
        if run.made_once is not None:
            leakfree.remove_offload_hooks(run.model)


# --- measurements -------------------------------------------------------------------------


def saved_tensors(work: Workload) -> int:
    """Tensors autograd saves in one forward (a pass-through ``saved_tensors_hooks``)."""
    n = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal n
        n += 1
        return t

    model = copy.deepcopy(work.model)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        work.loss(model)
    return n


def moved_bytes_per_step(run: Run) -> int:
    """Bytes leakfree copies to the host in one step (its ``stats``, second step)."""
    step(run)
    before = run.made_once.stats.to_host_bytes
    step(run)
    return int(run.made_once.stats.to_host_bytes - before)


def step_times(runs: dict[str, Run], quick: bool) -> Timings:
    """Microseconds per step of every mode, steps interleaved round by round (``compare``)."""
    fns = {mode: (lambda run=run: step(run)) for mode, run in runs.items()}
    return compare(fns, **rounds(quick))


def rounds(quick: bool) -> dict[str, int]:
    return {"repeat": 3, "number": 1, "warmup": 1} if quick else {"repeat": 25, "number": 4}


def copies_per_step(run: Run, sim: Any) -> dict[str, int]:
    """Host<->device copies of one step (the device's own counter, reset after the inputs
    were made and before the forward)."""
    sim.reset_copies()
    step(run)
    keys = ("to_host", "to_host_bytes", "to_device", "to_device_bytes")
    return {k: int(sim.copies[k]) for k in keys}


def own_code(mode: str) -> str | None:
    """The path prefix of the offloader's own code for ``mode`` (None: no offloader)."""
    if mode == "none":
        return None
    if mode == "save_on_cpu":
        return str(Path(torch.autograd.graph.__file__))
    if mode.startswith("trl"):
        import trl

        return str(Path(trl.__file__).parent) + os.sep
    return str(Path(leakfree.__file__).parent) + os.sep


def python_calls(run: Run) -> tuple[int, int]:
    """Python function calls in one step, and how many are in the offloader's own code.

    Counts ``"call"`` profile events (the simulated device's kernels included) on the
    calling thread and on the autograd engine's device thread, where backward, unpack hooks
    and the device's kernels run: a hook on the loss switches the profiler on there, a
    callback at the end of the backward switches it off.
    """
    own = own_code(run.mode)
    counts = [0, 0]
    active = True

    def profile(frame: Any, event: str, arg: Any) -> None:
        if not active:  # a thread the end-of-backward callback did not reach
            sys.setprofile(None)
        elif event == "call":
            counts[0] += 1
            if own is not None and frame.f_code.co_filename.startswith(own):
                counts[1] += 1

    def on_backward_thread(grad: torch.Tensor) -> None:
        sys.setprofile(profile)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: sys.setprofile(None))

    sys.setprofile(profile)
    try:
        with run.context():
            loss = run.loss(run.model)
        loss.register_hook(on_backward_thread)
        loss.backward()
    finally:
        sys.setprofile(None)
        active = False
    return counts[0], counts[1]


def peak_bytes(run: Run, sim: Any) -> tuple[int, int, int]:
    """Device bytes at most above what was allocated at the step's start: allocated at the
    end of the forward and over the whole step, and held (reserved by the caching
    allocator, its cache emptied before the step) over the step. The gradients of an
    earlier step are already allocated (backward adds into them), so the peaks are
    activations, copies and temporaries."""
    step(run)  # gradients exist
    sim.module.empty_cache()  # held: this mode's own blocks, not what earlier ones cached
    start = sim.allocated()
    sim.reset_peak()
    with run.context():
        loss = run.loss(run.model)
    forward = sim.peak() - start
    loss.backward()
    return forward, sim.peak() - start, sim.held_peak() - start


def gradients(run: Run) -> list[torch.Tensor]:
    """Every parameter's gradient after one step from no gradients, copied to the host."""
    run.model.zero_grad(set_to_none=True)
    step(run)
    return [p.grad.cpu() for p in run.model.parameters() if p.grad is not None]


def live_bytes(run: Run, sim: Any, steps: int) -> list[int]:
    """Device bytes allocated after each of ``steps`` steps (gradients accumulate in place,
    so a mode that keeps nothing between steps is flat from the first)."""
    out = []
    for _ in range(steps):
        step(run)
        out.append(sim.allocated())
    return out


# --- the section --------------------------------------------------------------------------


def measure(work: Workload, sim: Any, quick: bool) -> dict[str, Any]:
    """Every measurement of every mode of ``work``; prints its table, returns its JSON."""
    saved = saved_tensors(work)
    s = setup(work)
    times = step_times(s.runs, quick)
    live_steps = 4 if quick else 20
    modes: dict[str, Any] = {}
    for mode in MODES:
        if mode not in s.runs:
            modes[mode] = {"available": False, "reason": s.unavailable[mode]}
            continue
        m = modes[mode] = {"available": True, "us_per_step": times[mode]}
        m["us_per_step_spread"] = times.spread(mode).as_dict()
        for base in ("none", "trl manager", "save_on_cpu"):
            key = "ratio_vs_" + base.replace(" ", "_")
            m[key] = times.ratio(mode, base).as_dict() if base in times else None
        m |= counters(s.runs[mode], sim, saved, live_steps)
    reference = modes["none"]["grads"]
    for m in modes.values():
        if m["available"]:
            grads = m.pop("grads")
            m["grads_bit_identical"] = len(grads) == len(reference) and all(
                torch.equal(a, b) for a, b in zip(grads, reference)
            )
            over = m["python_calls_per_step"] - modes["none"]["python_calls_per_step"]
            m["python_calls_over_none_per_saved_tensor"] = over / saved
    teardown(s)
    r = rounds(quick)
    result = {
        "title": work.title,
        "saved_tensors_per_step": saved,
        "leakfree_moved_bytes_per_step": s.leakfree_moved_bytes,
        "device_budget": s.budget,
        "rounds": r["repeat"],
        "steps_per_round": r["number"],
        "live_steps": live_steps,
        "modes": modes,
    }
    print_section(result)
    return result


def counters(run: Run, sim: Any, saved: int, live_steps: int) -> dict[str, Any]:
    """What one mode does apart from its time: copies, Python calls, peaks, gradients (as
    ``grads``, compared by the caller) and live device bytes step after step."""
    calls, own = python_calls(run)
    forward_peak, step_peak, step_held = peak_bytes(run, sim)
    offloader = own_code(run.mode) is not None
    live = live_bytes(run, sim, live_steps)
    return {
        "copies_per_step": copies_per_step(run, sim),
        "python_calls_per_step": calls,
        "python_calls_per_saved_tensor": calls / saved,
        "offloader_calls_per_step": own if offloader else None,
        "offloader_calls_per_saved_tensor": own / saved if offloader else None,
        "forward_peak_bytes": forward_peak,
        "step_peak_bytes": step_peak,
        "step_held_bytes": step_held,
        "grads": gradients(run),
        "live_bytes_after_each_step": live,
        "flat": live[1] == live[-1],
    }


def print_section(result: dict[str, Any]) -> None:
    budget = result["device_budget"]
    title = (
        f"simulated accelerator (tests/simdev: host memory, one Python kernel per op): "
        f"{result['title']}; {result['saved_tensors_per_step']} saved tensors per step; "
        f"{result['rounds']} rounds x {result['steps_per_round']} steps, interleaved; "
        f"ratios: median (IQR) round by round; "
        f"budget = {_kib(budget)} KiB (half of what leakfree moves); "
        f"flat: live device bytes after step 2 = after step {result['live_steps']}"
    )
    header = [
        "mode",
        "us/step",
        "vs none",
        "vs trl manager",
        "vs save_on_cpu",
        "to host: n (KiB)",
        "to device: n (KiB)",
        "py calls/saved (over none)",
        "own calls/saved",
        "fwd peak KiB",
        "step peak KiB",
        "step held KiB",
        "grads equal",
        "flat",
    ]
    rows = []
    for mode, m in result["modes"].items():
        if not m["available"]:
            rows.append([mode, f"not available: {m['reason']}"] + ["-"] * (len(header) - 2))
            continue
        c = m["copies_per_step"]
        own = m["offloader_calls_per_saved_tensor"]
        rows.append(
            [
                mode,
                m["us_per_step"],
                _short(m["ratio_vs_none"]),
                _short(m["ratio_vs_trl_manager"]),
                _short(m["ratio_vs_save_on_cpu"]),
                f"{c['to_host']} ({_kib(c['to_host_bytes'])})",
                f"{c['to_device']} ({_kib(c['to_device_bytes'])})",
                f"{m['python_calls_per_saved_tensor']:.0f} "
                f"({m['python_calls_over_none_per_saved_tensor']:+.1f})",
                "-" if own is None else f"{own:.1f}",
                _kib(m["forward_peak_bytes"]),
                _kib(m["step_peak_bytes"]),
                _kib(m["step_held_bytes"]),
                m["grads_bit_identical"],
                m["flat"],
            ]
        )
    print_table(title, header, rows)


def _short(spread: dict[str, float] | None) -> str:
    """A ratio's median (IQR), two decimals: the table has three ratio columns."""
    if spread is None:
        return "-"
    return f"{spread['median']:.2f} ({spread['q1']:.2f}-{spread['q3']:.2f})"


def _kib(n: int | None) -> str:
    return "-" if n is None else f"{n / 1024:.0f}"


def _simdev() -> Any:
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests import simdev

    return simdev


def register() -> None:
    """Register the simulated device; call before the process's first backward (the
    autograd engine sizes its device queues then)."""
    _simdev().register()


@contextlib.contextmanager
def simulated_device() -> Iterator[Any]:
    """The simulated device, switched on for the block (None where this torch has none)."""
    simdev = _simdev()
    if not simdev.supported():
        yield None
        return
    with simdev.enabled() as sim, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no-head and deprecation warnings of the modes
        yield sim
