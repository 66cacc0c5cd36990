"""One torch.distributed.pipelining run, measured from outside: shared by the integration
tests (tests/integration/test_pipelining_repair.py) and benchmarks/pipelining_memory.py.

The model is 8 blocks of Linear(dim) + GELU split evenly over the stages; each schedule trains
it with SGD for a few steps on the ranks of the current process group. What is measured
does not ask leakfree (or torch's private state) anything it could get wrong:

* **live bytes**: a ``TorchDispatchMode`` records a ``StorageWeakRef`` of every tensor an op
  returns, tagged with what the stage was doing (``recv``: allocating receive buffers, in
  ``get_*_recv_ops`` or the setup); a storage counts while its weak reference lives;
* **sent outputs**: a weak reference to the storage of each non-last stage's output per
  microbatch, sampled at the start of every forward and the start and end of every
  backward of the rank (an output is counted once its forward has returned);
* **hooks**: a forward pre-hook on each stage module registers a tensor hook on each input
  (as gradient-collection code does) and the hooks' fires are counted per step;
* **gradients and losses**: compared with ``torch.equal`` to the same model run
  microbatch by microbatch in one process, in the same order.

Knobs (``Config``): the schedule, the variant of the stage module (``plain``,
``checkpoint``: activation checkpointing inside each block, ``offload``: each stage's
forward under ``leakfree.OffloadActivations(force_host_copy=True)``), the ``losses=`` sink
(``list`` or ``PipelineLosses``), and ``patch``: ``None`` (unpatched) or the keyword
arguments for ``leakfree.patch_all``.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

DIM = 64  # the tests' width; the benchmark runs the issue's 256
BLOCKS = 8
BATCH = 32
N_MB = 8

#: schedules with one stage per rank; the others get two (looped or V-shaped)
SINGLE = ("ScheduleGPipe", "Schedule1F1B")
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
MULTI = ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble")
#: schedules whose backwards run the microbatches last to first (the one-process reference
#: accumulates in that order too, so the bits can match)
BACKWARD_REVERSED = ("ScheduleLoopedBFS",)
ALL = (*SINGLE, *MULTI, *V_SHAPED)


@dataclass(frozen=True)
class Config:
    schedule: str = "ScheduleGPipe"
    variant: str = "plain"  # plain | checkpoint | offload
    sink: str = "list"  # list | PipelineLosses
    patch: dict[str, Any] | None = None  # None: unpatched; else patch_all(**patch)
    steps: int = 5
    hooks: bool = True
    dim: int = DIM
    observe: bool = True  # False: no dispatch mode or wrappers (the benchmark's step time)


@dataclass
class Result:
    grads_equal_reference: list[bool] = field(default_factory=list)
    losses: list[list[float]] = field(default_factory=list)
    reference_losses: list[list[float]] = field(default_factory=list)
    grads: list[str] = field(default_factory=list)  # per step: a digest of the bits
    hook_fires: list[int] = field(default_factory=list)
    input_leaves: list[int] = field(default_factory=list)  # stage inputs that are leaves
    caller_bytes: list[int] = field(default_factory=list)  # what step() handed back, kept
    live_bytes: list[int] = field(default_factory=list)  # after each step (optimizer too)
    recv_bytes_between: list[int] = field(default_factory=list)
    recv_bytes_peak: list[int] = field(default_factory=list)  # within each step
    peak_bytes: list[int] = field(default_factory=list)  # within each step
    sent_alive_peak: list[int] = field(default_factory=list)  # outputs, at any sample
    sent_alive_at_first_backward: list[int] = field(default_factory=list)
    loss_graphs: list[int] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    in_flight_peak: list[int] = field(default_factory=list)  # microbatches between F and B
    peak_floor: list[int] = field(default_factory=list)  # what the peak cannot go below


class _Block(nn.Module):
    def __init__(self, variant: str, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.variant = variant

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.lin(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.variant == "checkpoint":
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self._f, x, use_reentrant=False)  # type: ignore[no-any-return]
        return self._f(x)


class _Part(nn.Sequential):
    """A stage's blocks; ``offload``: its forward runs under leakfree's offloader."""

    def __init__(self, blocks: list[nn.Module], variant: str) -> None:
        super().__init__(*blocks)
        self.variant = variant

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.variant == "offload":
            import leakfree

            with leakfree.OffloadActivations(force_host_copy=True, min_offload_size=0):
                return super().forward(x)
        return super().forward(x)


def _model(variant: str, dim: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[_Block(variant, dim) for _ in range(BLOCKS)])


def _batch(step: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, dim, generator=g), torch.randn(BATCH, dim, generator=g)


def stage_indices(schedule: str, rank: int, world: int) -> list[int]:
    if schedule in SINGLE:
        return [rank]
    if schedule in V_SHAPED:
        return [rank, 2 * world - 1 - rank]
    return [rank, rank + world]


def _num_stages(schedule: str, world: int) -> int:
    return world if schedule in SINGLE else 2 * world


def _split(model: nn.Sequential, n_stages: int, index: int) -> list[nn.Module]:
    per = BLOCKS // n_stages
    return list(model[index * per : (index + 1) * per])


class _Live(TorchDispatchMode):
    """Every storage an op returns, weakly, with the tag current when it was made."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int, str]] = {}
        self.tag = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # Only storages the op made: a view (weight.t()) shares its input's, which may be a
        # parameter made before the count began.
        given = {
            t.untyped_storage()._cdata
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage._cdata
                if key in given:
                    continue
                if key not in self.refs or self.refs[key][0].expired():
                    self.refs[key] = (StorageWeakRef(storage), storage.nbytes(), self.tag)
        return out

    def live(self, tag: str | None = None) -> int:
        dead = [k for k, (ref, _, _) in self.refs.items() if ref.expired()]
        for k in dead:
            del self.refs[k]
        return sum(n for _, n, t in self.refs.values() if tag is None or t == tag)

    @contextlib.contextmanager
    def tagged(self, tag: str) -> Iterator[None]:
        before, self.tag = self.tag, tag
        try:
            yield
        finally:
            self.tag = before


class _Probe:
    """What one rank samples at the start and end of each forward and backward."""

    def __init__(self, live: _Live) -> None:
        self.live = live
        self.sent: list[StorageWeakRef] = []  # this step's outputs, weakly
        self.sent_peak = 0
        self.bytes_peak = 0
        self.recv_peak = 0
        self.at_first_backward: int | None = None
        self.in_flight = 0
        self.in_flight_peak = 0

    def reset(self) -> None:
        self.sent.clear()
        self.sent_peak = 0
        self.recv_peak = 0
        self.bytes_peak = self.live.live()
        self.at_first_backward = None
        self.in_flight = self.in_flight_peak = 0

    def alive(self) -> int:
        return sum(1 for ref in self.sent if not ref.expired())

    def sample(self) -> None:
        self.sent_peak = max(self.sent_peak, self.alive())
        self.bytes_peak = max(self.bytes_peak, self.live.live())
        self.recv_peak = max(self.recv_peak, self.live.live("recv"))


def _instrument(stage: Any, probe: _Probe) -> None:
    """Instance-level wrappers (the class's methods, patched or not, run inside them)."""
    cls = type(stage)
    live = probe.live

    def tagged(name: str) -> None:
        method = getattr(cls, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with live.tagged("recv"):
                return method(stage, *args, **kwargs)

        setattr(stage, name, wrapper)

    for name in (
        "get_fwd_recv_ops",
        "get_bwd_recv_ops",
        "_prepare_forward_infra",
        "_prepare_backward_infra",
    ):
        tagged(name)

    forward, backward = cls.forward_one_chunk, cls.backward_one_chunk

    def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        probe.sample()
        out = forward(stage, fwd_chunk_id, *args, **kwargs)
        if stage.has_backward:
            probe.in_flight += 1
            probe.in_flight_peak = max(probe.in_flight_peak, probe.in_flight)
        if not stage.is_last:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    probe.sent.append(StorageWeakRef(t.untyped_storage()))
        return out  # sampled at the next call: the output just made is not sent yet

    def backward_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if probe.at_first_backward is None:
            probe.at_first_backward = probe.alive()
        probe.sample()
        out = backward(stage, bwd_chunk_id, *args, **kwargs)
        probe.in_flight -= 1
        probe.sample()
        return out

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk


def _floor(config: Config, in_flight: int, parts: list[nn.Module], first: bool, last: bool) -> int:
    """A lower bound of what a rank must hold at its peak, from autograd's needs alone: the
    larger of (what autograd saves for every microbatch between its forward and its
    backward, each block's Linear and GELU inputs, plus one output in flight) and (the
    parameters' gradients once backward is done), plus the step's batch (first stage:
    inputs, last stage: targets). Receive buffers, sent outputs and caches are not in it:
    the repair's business is to make them cost nothing beyond it."""
    act = BATCH // N_MB * config.dim * 4
    blocks = sum(len(p) for p in parts) // max(len(parts), 1)
    grads = sum(p.numel() * 4 for part in parts for p in part.parameters())
    batch = BATCH * config.dim * 4
    saved = in_flight * 2 * blocks * act + act * (not last)
    return max(saved, grads) + batch * (first + last)


def _count_hooks(module: nn.Module, fires: list[int], leaves: list[int]) -> None:
    def pre_hook(mod: nn.Module, args: tuple[Any, ...]) -> None:
        for a in args:
            if isinstance(a, torch.Tensor) and a.requires_grad:
                leaves[0] += a.is_leaf
                a.register_hook(lambda g: fires.__setitem__(0, fires[0] + 1))

    module.register_forward_pre_hook(pre_hook)


def _stage(schedule: str, index: int, n_stages: int, module: nn.Module, dim: int) -> Any:
    from torch.distributed import pipelining

    kw: dict[str, Any] = {}
    param = inspect.signature(pipelining.PipelineStage.__init__).parameters.get("input_args")
    if param is not None and param.default is inspect.Parameter.empty:  # torch < 2.6
        kw = {"input_args": (torch.empty(BATCH // N_MB, dim),)}
    return pipelining.PipelineStage(module, index, n_stages, torch.device("cpu"), **kw)


def run(config: Config, rank: int, world: int) -> Result:
    """Train ``config.steps`` steps on this rank; every rank of the group calls it."""
    from torch.distributed import pipelining

    import leakfree
    from leakfree.pipeline import PipelineLosses

    leakfree.unpatch_all()
    if config.patch is not None:
        leakfree.patch_all(**config.patch)
    r = Result()
    live = _Live()
    model, ref = _model(config.variant, config.dim), _model(config.variant, config.dim)
    n_stages = _num_stages(config.schedule, world)
    indices = stage_indices(config.schedule, rank, world)
    parts = [_Part(_split(model, n_stages, i), config.variant) for i in indices]
    ref_parts = [_Part(_split(ref, n_stages, i), config.variant) for i in indices]
    fires, leaves = [0], [0]
    if config.hooks:
        for p in parts:
            _count_hooks(p, fires, leaves)
    params = [p for part in parts for p in part.parameters()]
    ref_params = [p for part in ref_parts for p in part.parameters()]
    opt = torch.optim.SGD(params, lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    probe = _Probe(live)
    with live if config.observe else contextlib.nullcontext():
        stages = [
            _stage(config.schedule, i, n_stages, part, config.dim)
            for i, part in zip(indices, parts)
        ]
        for stage in stages:
            if config.observe:
                _instrument(stage, probe)
        cls = getattr(pipelining, config.schedule)
        schedule = cls(
            stages if config.schedule not in SINGLE else stages[0],
            n_microbatches=N_MB,
            loss_fn=nn.functional.mse_loss,
        )
        scale = bool(getattr(schedule, "scale_grads", True))
        losses: list[torch.Tensor] = [] if config.sink == "list" else PipelineLosses()
        has_first = 0 in indices
        has_last = (n_stages - 1) in indices
        for step in range(config.steps):
            x, y = _batch(step, config.dim)
            fires[0] = leaves[0] = 0
            if config.observe:
                probe.reset()
            dist.barrier()
            t0 = time.perf_counter()
            kwargs: dict[str, Any] = {}
            if has_last:
                kwargs = {"target": y, "losses": losses}
            if has_first:
                schedule.step(x, **kwargs)
            else:
                schedule.step(**kwargs)
            r.step_seconds.append(time.perf_counter() - t0)
            r.sent_alive_peak.append(probe.sent_peak)
            r.sent_alive_at_first_backward.append(probe.at_first_backward or 0)
            r.hook_fires.append(fires[0])
            r.input_leaves.append(leaves[0])
            r.peak_bytes.append(probe.bytes_peak)
            r.recv_bytes_peak.append(probe.recv_peak)
            r.in_flight_peak.append(probe.in_flight_peak)
            r.peak_floor.append(_floor(config, probe.in_flight_peak, parts, has_first, has_last))
            if has_last:
                r.losses.append([float(t.detach()) for t in losses])
                r.loss_graphs.append(sum(t.grad_fn is not None for t in losses))
            # the same model in one process, microbatch by microbatch
            ref_losses = []
            order = list(zip(x.tensor_split(N_MB), y.tensor_split(N_MB)))
            if config.schedule in BACKWARD_REVERSED:
                order.reverse()
            for xm, ym in order:
                loss = nn.functional.mse_loss(ref(xm), ym)
                loss.backward()
                ref_losses.append(float(loss.detach()))
            if config.schedule in BACKWARD_REVERSED:
                ref_losses.reverse()
            if scale:
                for p in ref.parameters():
                    p.grad.div_(N_MB)  # type: ignore[union-attr]
            r.reference_losses.append(ref_losses)
            r.grads_equal_reference.append(
                all(torch.equal(a.grad, b.grad) for a, b in zip(params, ref_params))  # type: ignore[arg-type]
            )
            flat = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
            r.grads.append(hashlib.sha256(flat.numpy().tobytes()).hexdigest())
            opt.step()
            opt_ref.step()
            opt.zero_grad(set_to_none=True)
            opt_ref.zero_grad(set_to_none=True)
            del x, y, xm, ym, loss, flat, order, kwargs
            r.live_bytes.append(live.live())
            kept = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in losses}
            r.caller_bytes.append(sum(kept.values()) if has_last else 0)
            r.recv_bytes_between.append(live.live("recv"))
    leakfree.unpatch_all()
    return r
