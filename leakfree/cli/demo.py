"""``python -m leakfree demo``: the five leak shapes, naive vs leakfree, measured.

Each shape is a tiny loop written twice: the way the leak was shipped, and with the
leakfree primitive. A :class:`~leakfree.diagnostics.MemoryTracker` samples live bytes after
every step (allocator statistics on an accelerator; tracked tensor storages on CPU, which
also see what only C++ autograd nodes hold), and the growth per step is fitted.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

import leakfree
from leakfree._device import accelerator
from leakfree._shapes import context_loss
from leakfree._text import format_bytes, format_table
from leakfree.diagnostics.detector import Rule
from leakfree.diagnostics.growth import Growth, fit_growth
from leakfree.diagnostics.memory import MemoryTracker
from leakfree.pipeline import RecvBufferPool

Step = Callable[[], None]


@dataclass
class ShapeResult:
    name: str
    where: str
    naive: list[int]
    fixed: list[int]

    @property
    def naive_growth(self) -> Growth:
        return fit_growth(self.naive[1:])

    @property
    def fixed_growth(self) -> Growth:
        return fit_growth(self.fixed[1:])


# --- 1. loss dict ------------------------------------------------------------------------------


def _loss_dict(lf: bool, device: torch.device) -> Step:
    """Fast-LLM: per-microbatch losses kept in a dict; the loss Function keeps context."""

    ContextLoss = context_loss(64 * 1024)  # 256 KiB per microbatch

    w = torch.randn(256, device=device, requires_grad=True)
    losses: Any = leakfree.LossLog(["lm"]) if lf else {"lm": []}

    def step() -> None:  # one microbatch of a long accumulation step
        loss = ContextLoss.apply(w * 1.0)  # type: ignore[no-untyped-call]
        loss.backward()
        losses["lm"].append(loss)

    return step


# --- 2. ctx attributes --------------------------------------------------------------------------


def _ctx_attributes(lf: bool, device: torch.device) -> Step:
    """A Function parks a workspace on ctx; the loop keeps each step's output for logging."""
    base: type = leakfree.Function if lf else torch.autograd.Function

    class Project(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x, w)
            # 1 MiB parked on ctx: the leak this part of the demo shows (without leakfree)
            ctx.workspace = torch.empty(256 * 1024, device=x.device)  # leakfree: ignore[LF001]
            return x @ w

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x, w = ctx.saved_tensors
            return g @ w.T, x.T @ g

    w = torch.randn(64, 64, device=device, requires_grad=True)
    kept: list[torch.Tensor] = []

    def step() -> None:
        out = Project.apply(torch.randn(32, 64, device=device), w).square().mean()
        out.backward()
        kept.append(out)

    return step


# --- 3. activation offloading ------------------------------------------------------------------


class _SideTableOffloader(saved_tensors_hooks):
    """The shipped pattern (TRL before 1.5): pack returns an id, payloads live in a dict
    owned by the context manager, and an entry goes only when it is unpacked."""

    def __init__(self) -> None:
        self.tracker: dict[int, torch.Tensor] = {}
        self.next_id = 0

        def pack(t: torch.Tensor) -> int:
            self.next_id += 1
            self.tracker[self.next_id] = t.detach().to("cpu", copy=True)  # leakfree: ignore[LF004]
            return self.next_id

        def unpack(key: int) -> torch.Tensor:
            return self.tracker.pop(key)

        super().__init__(pack, unpack)


def _offloading(lf: bool, device: torch.device) -> Step:
    """Each step also runs a branch whose backward never runs (MoE routing, eval)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
    ).to(device)
    ctx: Any = (
        leakfree.OffloadActivations(force_host_copy=device.type == "cpu", min_offload_size=1024)
        if lf
        else _SideTableOffloader()
    )
    if lf:
        ctx.update_model_params(model)

    def step() -> None:
        x = torch.randn(32, 64, device=device)
        with ctx:
            loss = model(x).square().mean()
            unused = model(x * 2).sum()  # its backward never runs
        loss.backward()
        del unused

    return step


# --- 4. pipeline receive ----------------------------------------------------------------------


def _pipeline_receive(lf: bool, device: torch.device) -> Step:
    """A stage keeps each microbatch's received input until the step ends."""
    w = torch.randn(256, device=device, requires_grad=True)
    incoming = torch.randn(16, 256, device=device)
    pool = RecvBufferPool()
    kept: list[Any] = []

    def step() -> None:
        if lf:
            entry = pool.acquire(incoming.shape, incoming.dtype, device)
            entry.tensor.copy_(incoming)
            x, entry.activation = entry.activation, None
            if x is None:
                raise RuntimeError("demo: a pool entry came back without its activation")
            (x * w).sum().backward()  # type: ignore[no-untyped-call]
            entry.slot.take()  # sent upstream
            kept.append(entry)
        else:
            x = incoming.clone().requires_grad_()  # a leaf per microbatch; .grad accumulates
            (x * w).sum().backward()  # type: ignore[no-untyped-call]
            kept.append(x)

    return step


# --- 5. patched third-party Function -----------------------------------------------------------


def _third_party(lf: bool, device: torch.device) -> Step:
    """Transformer Engine's shape: buffers restored into objects parked on ctx.tensor_objects.

    leakfree repairs the class in place, as ``patch_all()`` does for TE's classes.
    """

    class Storage:
        def __init__(self, data: torch.Tensor | None) -> None:
            self.data = data

    class FusedThing(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            obj = Storage(torch.empty(128 * 1024, device=x.device))  # 512 KiB buffer
            ctx.save_for_backward(x, obj.data)
            obj.data = None
            ctx.tensor_objects = [obj]
            return x * 2

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            _, buf = ctx.saved_tensors
            ctx.tensor_objects[0].data = buf  # restore_from_saved
            return g * 2

    if lf:
        leakfree.release_after_backward(FusedThing, attrs=("tensor_objects",))
    w = torch.randn(64, device=device, requires_grad=True)
    kept: list[torch.Tensor] = []

    def step() -> None:
        out = FusedThing.apply(w * torch.randn(64, device=device)).sum()  # type: ignore[no-untyped-call]
        out.backward()
        kept.append(out)

    return step


SHAPES: list[tuple[str, str, Callable[[bool, torch.device], Step]]] = [
    ("loss dict", "Fast-LLM context.losses", _loss_dict),
    ("ctx attributes", "TE ctx.tensor_objects, Tutel", _ctx_attributes),
    ("activation offloading", "TRL < 1.5 OffloadActivations", _offloading),
    ("pipeline receive", "leaf receive buffers", _pipeline_receive),
    ("third-party Function", "patched in place (patch_all)", _third_party),
]


#: What each loop keeps on purpose, with or without leakfree: the "leakfree after N" bytes.
KEPT_ON_PURPOSE = {
    "loss dict": "w.grad and the logged scalars (4 B each)",
    "ctx attributes": "w.grad and the kept outputs",
    "activation offloading": "the parameters' .grad (132 KiB) and the offloader's host "
    "blocks of the branch whose backward never runs, cached and reused every step",
    "pipeline receive": "w.grad, the pool's reused receive buffer and the kept entries",
    "third-party Function": "w.grad and the kept outputs (4 B each)",
}


def _device() -> torch.device:
    return accelerator() or torch.device("cpu")


def measure(
    make: Callable[[bool, torch.device], Step], lf: bool, steps: int, device: torch.device
) -> list[int]:
    """Live bytes on ``device`` after each step of the shape's loop."""
    # Only the series is read here: no verdict within these steps, no microbatch search.
    rule = Rule(warmup=steps + 1)
    tracker = MemoryTracker(
        devices=[device], sample_every=1, warn=False, rule=rule, microbatches=False
    )
    with tracker:
        step = make(lf, device)
        tracker.step()  # baseline: what setting up the loop allocated
        for _ in range(steps):
            step()
            tracker.step()
    series = tracker.series[str(device)]
    return [v - series[0] for v in series]


def run_demo(steps: int = 30, plot: str | None = "leakfree-demo.png") -> int:
    device = _device()
    print(f"leakfree {leakfree.__version__} demo on {device} (torch {torch.__version__})")
    print(f"{len(SHAPES)} leak shapes x {steps} steps, naive vs leakfree\n")
    results = []
    runs = [(name, where, make, lf) for name, where, make in SHAPES for lf in (False, True)]
    progress = _progress(len(runs))
    measured: dict[tuple[str, bool], list[int]] = {}
    for name, _where, make, lf in runs:
        measured[(name, lf)] = measure(make, lf, steps, device)
        progress(f"{name} ({'leakfree' if lf else 'naive'})")
    progress(None)
    for name, where, _make in SHAPES:
        results.append(ShapeResult(name, where, measured[(name, False)], measured[(name, True)]))

    header = (
        "leak shape",
        "seen in",
        "naive / step",
        "leakfree / step",
        f"naive after {steps}",
        f"leakfree after {steps}",
    )
    rows = [
        (
            r.name,
            r.where,
            format_bytes(r.naive_growth.bytes_per_step),
            format_bytes(r.fixed_growth.bytes_per_step),
            format_bytes(r.naive[-1]),
            format_bytes(r.fixed[-1]),
        )
        for r in results
    ]
    print(format_table(header, rows, right=range(2, len(header))))
    print(
        f"\nper step: least-squares growth of live bytes on {device}. after {steps}: live "
        "bytes above the loop's start. Every loop keeps what users keep on purpose, naive or "
        "not; with leakfree that is all that stays, and it does not grow:"
    )
    for r in results:
        print(f"  {r.name}: {KEPT_ON_PURPOSE[r.name]}")
    if plot:
        written = _plot(results, plot, device)
        print(
            f"plot: {written}"
            if written
            else "plot: skipped (install matplotlib, e.g. pip install 'leakfree[demo]')"
        )
    leaks_fixed = all(
        r.naive_growth.exceeds(0) and not r.fixed_growth.exceeds(1024) for r in results
    )
    return 0 if leaks_fixed else 1


def _progress(total: int) -> Callable[[str | None], None]:
    try:
        from tqdm import tqdm
    except ImportError:
        count = [0]

        def plain(label: str | None) -> None:
            if label is not None:
                count[0] += 1
                print(f"  [{count[0]}/{total}] {label}", file=sys.stderr)

        return plain
    # A bar only on a terminal: redirected, its carriage returns would run into the table.
    bar = tqdm(
        total=total, unit="run", file=sys.stderr, leave=False, disable=not sys.stderr.isatty()
    )

    def update(label: str | None) -> None:
        if label is None:
            bar.close()
        else:
            bar.set_postfix_str(label)
            bar.update()

    return update


def _plot(results: list[ShapeResult], path: str, device: torch.device) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    # Two columns: each panel wide enough to read at a page's width, each with its own
    # labels (a panel cut out of the figure still says what it shows).
    columns = 2
    rows = -(-len(results) // columns)
    fig, grid = plt.subplots(rows, columns, figsize=(10, 2.9 * rows), squeeze=False)
    for ax, r in zip(grid.flat, results):
        steps = range(len(r.naive))
        ax.plot(steps, [v / 2**20 for v in r.naive], color="#c0392b", lw=2, label="naive")
        ax.plot(steps, [v / 2**20 for v in r.fixed], color="#27ae60", lw=2, label="leakfree")
        ax.set_title(f"{r.name} ({r.where})", fontsize=11)
        ax.set_xlabel("step", fontsize=10)
        ax.set_ylabel(f"live MiB on {device}", fontsize=10)
        ax.legend(loc="upper left", fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(grid.flat)[len(results) :]:
        ax.axis("off")
    fig.suptitle("leakfree demo: memory held after each step, naive vs leakfree", fontsize=13)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
