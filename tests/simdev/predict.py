"""Predicted H100 steps of the H100 run's Llama, on the simulated device in dry mode.

The model of the H100 run (hidden 2048, 8 layers, 16 heads, intermediate 5440 (5632 in
the first H100 table), vocab 32000, bf16, sdpa, batch 2 x sequence 4096) is built on the
meta device and given uninitialised memory on the simulated device; its steps run in dry
mode (shapes only), so a full-size step takes a fraction of a second on the CPU. Each
mode runs warm-up steps (the offloader plans from them, as on the GPU), then, the cache
emptied, one step under :func:`timing.attach` with :data:`timing.H100`: its predicted
step time, activation peak (the caching allocator's allocated count, streams included),
held peak (its reserved count) and bytes each way.

The calibration is ``calibration.py``: the H100 run's tables (one H100 80GB, torch 2.11,
transformers 5.17, TRL 1.16, measured 2026-11-27), each with its own config. One rate is
fitted, the FLOP rate, on two rows: the step without offloading of the first table
(intermediate 5632) and of the second (5440). Every other row is held out: each
offloading row of both tables and of the GPU suite's batch-1 run, judged on its ratio to
its table's step without offloading, its activation peak and its bytes to the host.
The fit gives 5.93e14 FLOP/s; its errors (``calibration.report`` prints them per row):

=====================================  ========================  ======================
                                       before (5.72e14, fitted   after (5.93e14, fitted
                                       on second/none alone)     on both none rows)
=====================================  ========================  ======================
fitted rows, step time, worst          4.5%                      2.2%
held-out ratios (15 rows), worst       12.1% (first save_on_cpu) 10.9% (suite trl class)
held-out ratios, mean of abs           5.2%                      5.3%
held-out activation peaks (11), worst  11.5% (suite budget)      11.5%, others <= 6.9%
held-out bytes to host (9), worst      1.8%                      1.8%
=====================================  ========================  ======================

The refit moves the ratio error between tables rather than shrinking it: the first table's
rows are predicted low (-2% to -11%) and the suite's high (+2% to +11%): one FLOP rate
makes the batch-1 step without offloading too fast (smaller kernels reach less of the
peak), so every batch-1 ratio comes out high.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import device as _device
from . import timing

GiB = 1 << 30
#: the pinned host memory of the H100 machine's pool (a quarter of its 128 GiB)
PINNED = 32 * GiB


@dataclass(frozen=True)
class Prediction:
    """One mode's predicted step on the H100 model."""

    mode: str
    step: float  #: seconds
    activation_peak: int  #: bytes the step allocates beyond what was allocated before it
    #: bytes the device holds at the step's peak beyond what was allocated before it (the
    #: caching allocator's reserved count, the cache emptied before the step: blocks
    #: freed while other streams' copies still read them, per-stream pools, rounding)
    held_peak: int
    allocated_before: int  #: bytes allocated on the device when the step began
    to_host: int  #: bytes copied to the host
    to_device: int  #: bytes copied back
    copy_overlap: float  #: seconds both copy engines are busy at once
    compute: float  #: seconds the compute engine is busy
    plan: Any = None  #: leakfree's ``ctx.plan`` after the step, where leakfree runs
    timeline: Any = None  #: the step's :class:`timing.Timeline`
    first_to_host: int = 0  #: bytes copied to the host in the first step (warm-up or not)


def llama(device: torch.device, layers: int = 8, intermediate: int = 5440) -> torch.nn.Module:
    """the H100 run's Llama, its parameters uninitialised on ``device`` (bf16); the
    first H100 table's had ``intermediate`` 5632, the others 5440."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return model.to(dtype=torch.bfloat16).to_empty(device=device)


def leakfree_context(model: torch.nn.Module, **options: Any) -> Callable[[], Any]:
    import leakfree

    options.setdefault("pin_memory_budget", PINNED)
    ctx = leakfree.OffloadActivations(**options)
    ctx.update_model_params(model)
    return lambda: ctx


def _context(mode: str, model: torch.nn.Module, moved: int | None) -> Callable[[], Any]:
    if mode == "none":
        return contextlib.nullcontext
    if mode == "default":
        return leakfree_context(model)
    if mode == "use_streams=False":
        return leakfree_context(model, use_streams=False)
    if mode.startswith("budget "):
        if moved is None:
            raise ValueError(f"mode {mode!r}: needs the bytes the default moves")
        return leakfree_context(model, device_budget=int(float(mode.split()[1]) * moved))
    if mode.startswith("max_overhead="):
        return leakfree_context(model, max_overhead=float(mode.partition("=")[2]))
    if mode.startswith("device_limit="):
        return leakfree_context(model, device_limit=int(mode.partition("=")[2]))
    if mode == "save_on_cpu":
        return lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)
    if mode == "trl":
        from trl.models.activation_offloading import get_act_offloading_ctx_manager

        trl_ctx = get_act_offloading_ctx_manager(model)
        return lambda: trl_ctx
    raise ValueError(f"mode {mode!r}: unknown")


@contextlib.contextmanager
def as_measured() -> Iterator[None]:
    """leakfree's offloader with the schedule the H100 run measured (e7732f1): one
    side stream for both directions, the compute stream waiting for it at ``__exit__``,
    prefetch waiting for the compute stream into the side stream's own memory and begun
    by the first group brought back (not by a copy kept on the device), and the window of
    then: ``max_fwd_stash_size`` tensors, the oldest let go with
    ``record_stream`` where its copy may still run. (The calibration compares the model
    with those measurements: it must run what they ran.)"""
    from leakfree.offload.backward import Backward
    from leakfree.offload.handles import Arrival, _Group
    from leakfree.offload.hooks import OffloadActivations as Offload
    from leakfree.offload.options import Mode
    from leakfree.offload.plan import Planner
    from leakfree.offload.transfers import Transfers

    side, exit_, copy_in = Transfers.side, Offload.__exit__, Transfers.copy_in
    retire, window, ahead = Transfers._retire, Planner.window, Backward._ahead

    def groups_ahead(self: Any, state: Any, unit: Any) -> None:
        if isinstance(unit, _Group):  # a copy kept on the device started nothing then
            ahead(self, state, unit)

    def stash_window(self: Any) -> tuple[int | None, int | None]:
        # the automatic budget's window; a device budget had none (all let go at once)
        return None, self.options.stash if self.options.mode is Mode.AUTO else 0

    def recorded_retire(self: Any, keep_bytes: int | None, keep_count: int | None) -> None:
        flights = self.in_flight
        while flights and keep_count is not None and len(flights) > keep_count:
            t, event, nbytes = flights.popleft()
            self.in_flight_bytes -= nbytes
            if not event.query():
                t.record_stream(self.side(t.device, False))

    def one_side(self: Any, device: torch.device, back: bool) -> Any:
        return side(self, device, False)

    def waiting_exit(self: Any, *exc: object) -> None:
        transfers = self._transfers
        if self._depth == 1 and transfers.module is not None:
            for (device, _), stream in list(transfers.side_streams.items()):
                transfers.module.current_stream(device).wait_stream(stream)
        exit_(self, *exc)

    def waiting_copy_in(self: Any, group: Any, *, prefetch: bool = False) -> Any:
        if not (prefetch and self.use_streams):
            return copy_in(self, group, prefetch=prefetch)
        stream = self.side(group.device, True)
        stream.wait_stream(self.module.current_stream(group.device))
        host = group.on_host()
        self.stats.to_device += 1
        self.stats.to_device_bytes += group.used
        with self.module.stream(stream):
            if group.written is not None:
                stream.wait_event(group.written)
            dev = torch.empty(host.shape, dtype=host.dtype, device=group.device)
            dev.copy_(host, non_blocking=group.block.pinned)
            event = stream.record_event()
        group.block.event = event
        return dev, Arrival(event, stream)

    Transfers.side = one_side  # type: ignore[method-assign]
    Offload.__exit__ = waiting_exit  # type: ignore[method-assign]
    Transfers.copy_in = waiting_copy_in  # type: ignore[method-assign]
    Transfers._retire = recorded_retire  # type: ignore[method-assign]
    Planner.window = stash_window  # type: ignore[method-assign]
    Backward._ahead = groups_ahead  # type: ignore[method-assign]
    try:
        yield
    finally:
        Transfers.side, Transfers.copy_in = side, copy_in  # type: ignore[method-assign]
        Transfers._retire, Planner.window = retire, window  # type: ignore[method-assign]
        Backward._ahead = ahead  # type: ignore[method-assign]
        Offload.__exit__ = exit_  # type: ignore[method-assign]


@contextlib.contextmanager
def dry_device() -> Iterator[_device.SimDevice]:
    """The simulated device, on and dry, for one block."""
    with _device.enabled() as sim:
        sim.dry = True
        yield sim


def predict(
    sim: _device.SimDevice,
    mode: str | Callable[[torch.nn.Module], Callable[[], Any]],
    *,
    moved: int | None = None,
    warmup: int = 2,
    rates: timing.Rates = timing.H100,
    layers: int = 8,
    batch: int = 2,
    intermediate: int = 5440,
) -> Prediction:
    """Mode ``mode`` (a name :func:`_context` knows, or a function of the model giving
    the context of one step) on a fresh model: ``warmup`` steps, then one predicted.
    ``moved``: the bytes the default moves (for the ``budget`` modes). The device's
    memory is returned when it ends (the model's parameters dropped, the cache emptied),
    so that no prediction depends on the ones before it: the caching allocator's counts
    do (a cached block handed out whole counts its slack)."""
    sim.module.empty_cache()
    model = llama(sim.device, layers, intermediate)
    ids = torch.zeros(batch, 4096, dtype=torch.long, device=sim.device)
    context = mode(model) if callable(mode) else _context(mode, model, moved)
    name = mode if isinstance(mode, str) else getattr(mode, "__name__", "custom")
    firsts = []
    for _ in range(warmup):  # timed too: a plan is made from a measured step
        with timing.attach(rates) as t:
            _step(sim, model, ids, context)
        firsts.append(_sent(t))
    ctx = context()
    stats = getattr(ctx, "stats", None)
    before = (stats.to_host_bytes, stats.to_device_bytes) if stats is not None else (0, 0)
    # What the step itself makes the device hold, not what earlier steps left cached; no
    # cyclic collection inside it (an earlier mode's model freed mid-step would move the
    # counts by chance).
    sim.module.empty_cache()
    allocated_before = sim.allocated()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with timing.attach(rates) as t:
            _step(sim, model, ids, lambda: ctx)
    finally:
        if collecting:
            gc.enable()
    to_host = _sent(t)
    to_device = sum(op.nbytes for op in t.ops if op.engine == timing.TO_DEVICE)
    if stats is not None:  # what leakfree says it moved is what the model saw move
        assert (stats.to_host_bytes - before[0], stats.to_device_bytes - before[1]) == (
            to_host,
            to_device,
        ), (stats, before, to_host, to_device)
    prediction = Prediction(
        mode=name,
        step=t.end,
        activation_peak=t.peak - allocated_before,
        held_peak=t.held_peak - allocated_before,
        allocated_before=allocated_before,
        to_host=to_host,
        to_device=to_device,
        copy_overlap=t.overlap(timing.TO_HOST, timing.TO_DEVICE),
        compute=t.busy(timing.COMPUTE),
        plan=getattr(ctx, "plan", None),
        timeline=t,
        first_to_host=firsts[0] if firsts else to_host,
    )
    # the parameters go now, whatever cycles the contexts' hooks make with the model
    model.to_empty(device="meta")
    return prediction


def _sent(t: timing.Timeline) -> int:
    return sum(op.nbytes for op in t.ops if op.engine == timing.TO_HOST)


def _step(
    sim: _device.SimDevice, model: torch.nn.Module, ids: torch.Tensor, context: Callable[[], Any]
) -> None:
    with context():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    del loss
    sim.module.synchronize()
    for p in model.parameters():  # as an optimizer's zero_grad(set_to_none=True)
        p.grad = None


def frontier(sim: _device.SimDevice, *, trl: bool = True) -> dict[str, Prediction]:
    """Today's modes on the same model: no offloading, the default, the goals (a time cap;
    a memory ceiling 1 GiB under the step's peak, at the default's peak, at TRL's), the
    budgets, ``save_on_cpu`` and (``trl``, where installed) TRL's manager."""
    out: dict[str, Prediction] = {}
    none = out["none"] = predict(sim, "none")
    default = out["default"] = predict(sim, "default")
    base = none.allocated_before

    def limit(name: str, activation_bytes: int) -> None:
        out[name] = predict(sim, f"device_limit={base + activation_bytes}")

    for fraction in ("0.05", "0.25", "1.0"):
        out[f"max_overhead={fraction}"] = predict(sim, f"max_overhead={fraction}")
    limit("device_limit=peak-1GiB", none.activation_peak - GiB)
    limit("device_limit=default's peak", default.activation_peak)
    for mode in ("budget 0.75", "budget 0.50", "budget 0.25", "use_streams=False"):
        out[mode] = predict(sim, mode, moved=default.to_host)
    out["save_on_cpu"] = predict(sim, "save_on_cpu")
    if trl:
        out["trl"] = predict(sim, "trl")
        limit("device_limit=TRL's peak", out["trl"].activation_peak)
    return out


@dataclass(frozen=True)
class Step:
    """One step of a run of steps (:func:`steps`): its tokens per sequence, its time
    against no offloading at that length, what it allocated and held at most beyond what
    was allocated before it (held: reserved, what decides an out-of-memory error), the
    bytes it moved to the host, and the plan after it."""

    seq: int
    ratio: float
    activation_peak: int
    held_peak: int
    to_host: int
    plan: Any = None


def steps(
    sim: _device.SimDevice,
    mode: str,
    lengths: list[int],
    *,
    batch: int = 2,
    layers: int = 8,
    none: dict[int, float] | None = None,
) -> list[Step]:
    """``mode`` (a name :func:`_context` knows) on a fresh model over steps of ``lengths``
    tokens, each timed on the H100 model and compared with a step without offloading at
    its length (timed once per length, in ``none`` if given). The cache is emptied once,
    before the first step: what each step holds includes what the steps before it left
    cached, as in a training run."""
    none = {} if none is None else none
    sim.module.empty_cache()
    model = llama(sim.device, layers)
    context = _context(mode, model, None)
    out = []
    try:
        for seq in lengths:
            ids = torch.zeros(batch, seq, dtype=torch.long, device=sim.device)
            if seq not in none:
                with timing.attach(timing.H100) as t:
                    _step(sim, model, ids, contextlib.nullcontext)
                none[seq] = t.end
                sim.module.empty_cache()
            stats = getattr(context(), "stats", None)
            before_bytes = stats.to_host_bytes if stats is not None else 0
            allocated = sim.allocated()
            with timing.attach(timing.H100) as t:
                _step(sim, model, ids, context)
            out.append(
                Step(
                    seq,
                    t.end / none[seq],
                    t.peak - allocated,
                    t.held_peak - allocated,
                    _sent(t) if stats is None else stats.to_host_bytes - before_bytes,
                    getattr(context(), "plan", None),
                )
            )
    finally:
        model.to_empty(device="meta")
        sim.module.empty_cache()
    return out
