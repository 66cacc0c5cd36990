"""torch.distributed.pipelining, the supported pipeline path: 2 gloo processes on 127.0.0.1.

``ScheduleGPipe`` and ``Schedule1F1B``, 4 microbatches, 20 steps of SGD: each step's
gradients equal (``torch.equal``) those of the same model run in one process, live tensor
bytes are flat after step 2, and the losses handed back through
:class:`leakfree.pipeline.PipelineLosses` carry no graph, where the plain list keeps each
microbatch's graph (shown by a tensor a custom Function parks on ``ctx``: alive with the
plain list, freed with the sink).
"""

from __future__ import annotations

import inspect
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests._dist import run_workers

pipelining = pytest.importorskip("torch.distributed.pipelining")

N_MB, STEPS, D = 4, 20, 16
SPLIT = 4  # modules of the first stage


class _Tag(torch.autograd.Function):
    """Identity that parks a tensor on ctx (as some libraries' Functions do): backward
    frees saved tensors, not ctx attributes, so only the graph's death frees it."""

    refs: list[weakref.ref[torch.Tensor]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.extra = torch.zeros(1024)
        _Tag.refs.append(weakref.ref(ctx.extra))
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


class _Tagged(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Tag.apply(x)  # type: ignore[no-any-return]


def _model(tagged: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(D, 4 * D),
        nn.Tanh(),
        nn.Linear(4 * D, D),
        nn.Tanh(),
        _Tagged() if tagged else nn.Identity(),
        nn.Linear(D, 4 * D),
        nn.Tanh(),
        nn.Linear(4 * D, D),
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)


def _stage(rank: int, part: nn.Module) -> Any:
    kw: dict[str, Any] = {}
    param = inspect.signature(pipelining.PipelineStage.__init__).parameters.get("input_args")
    if param is not None and param.default is inspect.Parameter.empty:
        kw = {"input_args": (torch.empty(8 // N_MB, D),), "output_args": (torch.empty(2, D),)}
    return pipelining.PipelineStage(part, rank, 2, torch.device("cpu"), **kw)


def _reference_step(model: nn.Sequential, step: int, scale: bool) -> None:
    """The same model in one process, microbatch by microbatch, in the schedule's order."""
    x, y = _batch(step)
    for xm, ym in zip(x.tensor_split(N_MB), y.tensor_split(N_MB)):
        nn.functional.mse_loss(model(xm), ym).backward()
    if scale:  # torch divides the accumulated gradients by n_microbatches (scale_grads)
        for p in model.parameters():
            p.grad.div_(N_MB)  # type: ignore[union-attr]


def _run(
    rank: int, schedule_name: str, sink: str, tagged: bool = True, outputs: bool = True
) -> dict[str, Any]:
    from leakfree import LossLog
    from leakfree.diagnostics import MemoryTracker
    from leakfree.pipeline import PipelineLosses

    model, ref = _model(tagged), _model(tagged)
    part = model[:SPLIT] if rank == 0 else model[SPLIT:]
    ref_part = ref[:SPLIT] if rank == 0 else ref[SPLIT:]
    opt = torch.optim.SGD(part.parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    schedule = getattr(pipelining, schedule_name)(
        _stage(rank, part), n_microbatches=N_MB, loss_fn=nn.functional.mse_loss
    )
    scale = bool(getattr(schedule, "scale_grads", False))
    log = LossLog(["loss"])
    losses: list[torch.Tensor] = [] if sink == "list" else PipelineLosses(log)
    equal, alive, values, logged, graphs = [], [], [], [], []
    # Live bytes of every storage created from here on (buffers, graphs, losses, the
    # reference's gradients), sampled after each step.
    tracker = MemoryTracker(devices=["cpu"], sample_every=1, warn=False)
    with tracker:
        for step in range(STEPS):
            _Tag.refs.clear()
            x, y = _batch(step)
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses, return_outputs=outputs)
            ours = len(_Tag.refs)
            _reference_step(ref, step, scale)
            del _Tag.refs[ours:]  # the reference's graphs died with its backward
            equal.append(
                all(
                    torch.equal(a.grad, b.grad)  # type: ignore[arg-type]
                    for a, b in zip(part.parameters(), ref_part.parameters())
                )
            )
            opt.step()
            opt_ref.step()
            opt.zero_grad(set_to_none=True)
            opt_ref.zero_grad(set_to_none=True)
            alive.append(sum(r() is not None for r in _Tag.refs))
            if rank == 1:
                values.append([t.item() for t in losses])
                graphs.append(sum(t.grad_fn is not None for t in losses))
            # What a loop does at each logging step: read the log, then let it go.
            logged += [t.item() for t in log["loss"]]
            log.clear()
            tracker.step()
    return {
        "equal": equal,
        "live": tracker.series["cpu"],
        "alive": alive,
        "graphs": graphs,
        "values": values,
        "logged": logged,
        "findings": [f.message for f in tracker.findings],
    }


def _worker(rank: int, world: int, schedule_name: str) -> dict[str, Any]:
    return {sink: _run(rank, schedule_name, sink) for sink in ("list", "sink")}


@pytest.mark.parametrize("schedule_name", ["ScheduleGPipe", "Schedule1F1B"])
def test_pipelining_bit_identical_flat_and_losses_without_graphs(
    schedule_name: str, tmp_path: Path
) -> None:
    if schedule_name == "Schedule1F1B" and torch.__version__ < "2.8":
        pytest.skip("Schedule1F1B hangs on gloo before torch 2.8 (docs/pipeline.md)")
    results = run_workers(_worker, 2, tmp_path, schedule_name, timeout=240)
    for rank, r in enumerate(results):
        for sink in ("list", "sink"):
            run = r[sink]
            assert all(run["equal"]), f"rank {rank} {sink}: gradients differ from one process"
            # Flat after step 2: the buffers, optimizer-free SGD and schedule state are
            # allocated by then; nothing is added per step.
            assert run["live"][2:] == [run["live"][1]] * (STEPS - 2), (rank, sink, run["live"])
    last = results[1]
    # The detector, watching every step: the first stage keeps nothing per microbatch;
    # the last stage's losses keep the state _Tag parks on ctx, one graph per microbatch,
    # and the schedule keeps each microbatch's output to return them merged (the default
    # return_outputs=True), said with the way out.
    assert results[0]["list"]["findings"] == []
    assert results[0]["sink"]["findings"] == []
    for sink in ("list", "sink"):
        outputs = [f for f in last[sink]["findings"] if "output_chunks" in f]
        assert len(outputs) == 1 and "return_outputs=False" in outputs[0], last[sink]
        last[sink]["findings"].remove(outputs[0])
    [kept] = [f for f in last["list"]["findings"] if "\n  losses[*]" in f]
    assert "kept per backward pass" in kept
    assert any("_Tag.ctx.extra" in f for f in last["list"]["findings"])  # what they keep
    if schedule_name == "ScheduleGPipe":
        assert last["sink"]["findings"] == []  # handed over detached, nothing kept
    else:
        # 1F1B backpropagates each microbatch before the next forward, while the schedule
        # keeps every loss, with its graph, in _internal_losses until the step ends: the
        # sink receives them only then. Named in the first step, whatever the sink.
        [inside] = last["sink"]["findings"]
        assert "of step 1" in inside and "schedule._internal_losses[*]  2 graphs" in inside
    assert last["list"]["graphs"] == [N_MB] * STEPS
    assert last["sink"]["graphs"] == [0] * STEPS
    # The plain list keeps each microbatch's graph until the next step replaces it: the
    # tensor the Function parked on ctx is alive. Through the sink, it was freed.
    assert last["list"]["alive"] == [N_MB] * STEPS
    assert last["sink"]["alive"] == [0] * STEPS
    # What the graph-free path hands back is the same numbers, and the log has every step.
    assert last["sink"]["values"] == last["list"]["values"]
    assert all(len(v) == N_MB for v in last["sink"]["values"])
    assert last["sink"]["logged"] == [v for step in last["list"]["values"] for v in step]
    assert results[0]["sink"]["logged"] == []  # only the last stage has losses


def test_pipeline_losses_with_a_real_schedule() -> None:
    """torch's own ScheduleGPipe (one stage, one gloo rank): what it hands back through the
    sink is the plain list's numbers, without graphs, and the log collects every step."""
    import torch.distributed as dist

    from leakfree import LossLog
    from leakfree.pipeline import PipelineLosses
    from tests._dist import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        runs = {}
        for kind in ("plain", "sink"):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
            stage = pipelining.PipelineStage(model, 0, 1, torch.device("cpu"))
            schedule = pipelining.ScheduleGPipe(stage, 2, loss_fn=nn.functional.mse_loss)
            log = LossLog(["loss"])
            losses: list[torch.Tensor] = [] if kind == "plain" else PipelineLosses(log)
            seen = []
            for step in range(3):
                g = torch.Generator().manual_seed(step)
                x = torch.randn(4, 4, generator=g)
                schedule.step(x, target=torch.zeros(4, 4), losses=losses)
                seen.append([t.detach().item() for t in losses])
                graphs = [t.grad_fn is not None for t in losses]
                assert graphs == [kind == "plain"] * 2
            runs[kind] = (seen, [t.item() for t in log["loss"]])
    finally:
        dist.destroy_process_group()
    assert runs["sink"][0] == runs["plain"][0]
    assert runs["sink"][1] == [v for step in runs["plain"][0] for v in step]


def test_pipelining_example_runs(tmp_path: Path) -> None:
    from tests._fresh import run_python

    example = Path(__file__).resolve().parents[2] / "examples" / "pipelining.py"
    argv = (str(example), "--steps", "10", "--schedule", "ScheduleGPipe")
    # forked from the torch-preloaded server; the example spawns its two ranks itself
    status, stdout, stderr = run_python(*argv, cwd=tmp_path, timeout=240)
    assert status == 0, stderr[-2000:]  # it exits 1 if memory grows
    assert "steps 5-9: mean loss" in stdout
    assert "rank 0: live bytes" in stdout and "rank 1: live bytes" in stdout


def _clean_worker(rank: int, world: int) -> dict[str, Any]:
    import leakfree

    leakfree.patch_all()
    try:  # the merged outputs are not read: not kept either
        return _run(rank, "Schedule1F1B", "list", tagged=False, outputs=False)
    finally:
        leakfree.unpatch_all()


def test_pipelining_clean_run_is_quiet(tmp_path: Path) -> None:
    """The plain torch API (losses=[], return_outputs=False) on a model without ctx state,
    repaired by patch_all: the detector, watching every step and every backward, finds
    nothing."""
    if torch.__version__ < "2.8":
        pytest.skip("Schedule1F1B hangs on gloo before torch 2.8 (docs/pipeline.md)")
    for rank, r in enumerate(run_workers(_clean_worker, 2, tmp_path, timeout=240)):
        assert r["findings"] == [], (rank, r["findings"])
        assert all(r["equal"]), rank
