"""The device the GPU suite measures: a CUDA GPU, or the simulated H100 of ``tests/simdev``.

:class:`Bench` owns what every part of ``gpu_suite.py`` needs and does the same way on both:
the measured Llama built on the device itself (never on the CPU and moved), a step timed
with its allocated and held peaks (:class:`Peaks`), the device's memory counters, the
cleanup after an out-of-memory error, and each way of keeping activations (:func:`context`).
On CUDA a step is timed by the host's clock around a synchronised step; on the simulated
device (``--dry``: shapes only, nothing computed) by the H100 timing model
(``tests/simdev/timing.py``), which every step runs under, so that copies end, and the
memory they hold is given back, when the model says so.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

import leakfree

GiB = 1 << 30


@dataclass(frozen=True)
class Size:
    """A Llama from a ``transformers`` config, and its batch."""

    hidden: int = 2048
    layers: int = 8
    intermediate: int = 5440
    heads: int = 16
    vocab: int = 32000
    batch: int = 2
    seq: int = 4096

    def with_(self, **changes: int | None) -> Size:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


#: the Llama of the H100 run (its second table and the first suite run: intermediate 5440),
#: the size every prediction of docs/offload.md is for
FULL = Size()
#: a quick dry run's (``--layers 2 --vocab 8000``: a dry step costs a Python call per op,
#: so per layer): a quarter of the vocabulary, so that the layers' activations weigh
#: against the rest (the loss's float32 logits) about as at the full size
SMALL = Size(layers=2, vocab=8000)
#: what the dry run computes for real (the gradients part needs values)
VALUES = Size(hidden=64, layers=2, intermediate=128, heads=4, vocab=256, seq=64)


class Unavailable(Exception):
    """A mode that cannot run here (a package missing, a measurement it needs missing)."""


@dataclass
class Step:
    """One step: its seconds, and what it allocated and held at most beyond what was
    allocated when it began (``held``: the caching allocator's reserved bytes, cached
    blocks included, which decide an out-of-memory error)."""

    seconds: float
    before: int  #: bytes allocated when the step began
    allocated: int  #: peak allocated beyond ``before``
    held: int  #: peak reserved beyond ``before``
    after: int  #: bytes allocated after the step (its gradients dropped, garbage collected)
    to_host: int | None = None  #: bytes a leakfree manager sent to the host in the step

    @property
    def held_total(self) -> int:
        """The peak reserved bytes of the device (what ``device_limit`` bounds)."""
        return self.before + self.held

    @property
    def allocated_total(self) -> int:
        return self.before + self.allocated


class Peaks:
    """The most the device allocated and held during a step: the suite resets the peak
    counters once, before the step, and reads them after it. (leakfree never resets them:
    it reads a step's peaks as deltas, so the reading is the step's, a measured or
    checked one's too; tests/integration/test_gpu_suite.py checks it.)"""

    def __init__(self, module: Any, device: torch.device) -> None:
        self.module, self.device = module, device
        self.allocated = self.reserved = 0

    @contextlib.contextmanager
    def during(self) -> Iterator[Peaks]:
        # The suite's one reset, before the step: the counters count from the last reset
        # only, and nothing else gives a step's peak (the memory history would slow every
        # allocation of the step it measures).
        self.module.reset_peak_memory_stats(self.device)
        self.allocated = self.reserved = 0
        try:
            yield self
        finally:
            self.allocated = int(self.module.max_memory_allocated(self.device))
            self.reserved = int(self.module.max_memory_reserved(self.device))


class Bench:
    """The device under test (see the module doc). ``sim``: the simulated device, when
    dry; ``pinned``: each leakfree manager's own pinned host budget, in bytes."""

    def __init__(
        self,
        device: torch.device,
        size: Size,
        *,
        dtype: torch.dtype = torch.bfloat16,
        pinned: int = 32 * GiB,
        sim: Any = None,
    ) -> None:
        self.device, self.size, self.dtype, self.pinned, self.sim = device, size, dtype, pinned, sim
        self.module = torch.get_device_module(device.type)
        self.peaks = Peaks(self.module, device)
        self._timing: Any = None
        if sim is not None:
            from tests.simdev import timing

            self._timing = timing

    @property
    def dry(self) -> bool:
        return self.sim is not None and bool(self.sim.dry)

    def where(self) -> str:
        if self.sim is None:
            return str(self.module.get_device_name(self.device))
        how = "dry: shapes only, timed by the H100 model" if self.dry else "computing"
        return f"simulated H100 (tests/simdev, {how})"

    # -- memory ---------------------------------------------------------------------------

    def sync(self) -> None:
        self.module.synchronize(self.device)

    def allocated(self) -> int:
        return int(self.module.memory_allocated(self.device))

    def reserved(self) -> int:
        return int(self.module.memory_reserved(self.device))

    def total(self) -> int:
        return int(self.module.get_device_properties(self.device).total_memory)

    def empty_cache(self) -> None:
        self.sync()
        gc.collect()
        self.module.empty_cache()

    def cap(self, nbytes: int | None) -> None:
        """Cap what the process may hold (``set_per_process_memory_fraction``); None: the
        whole device again."""
        fraction = 1.0 if nbytes is None else min(1.0, nbytes / self.total())
        self.module.set_per_process_memory_fraction(fraction, self.device)

    # -- the model ------------------------------------------------------------------------

    def model(self, size: Size | None = None, *, checkpointing: bool = False) -> Any:
        """The Llama of ``size`` (default: the bench's), built on the device in its dtype
        with ``transformers``' own initialisation, seeded: every call gives the same
        weights."""
        from transformers import LlamaConfig, LlamaForCausalLM

        size = size or self.size
        config = LlamaConfig(  # type: ignore[call-arg]
            hidden_size=size.hidden,
            intermediate_size=size.intermediate,
            num_hidden_layers=size.layers,
            num_attention_heads=size.heads,
            num_key_value_heads=size.heads,
            vocab_size=size.vocab,
            max_position_embeddings=max(size.seq, 4096),
            attn_implementation="sdpa",
        )
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(default)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": self.reentrant})  # type: ignore[no-untyped-call]
        return model

    @property
    def reentrant(self) -> bool:
        """Whether checkpointing recomputes in a function's backward rather than in a
        saved-tensor unpack hook: on the simulated device only, where an exception raised
        in an unpack hook on its autograd thread (out of memory in a recompute) aborts the
        process (torch 2.13, a Python backend), whereas one raised in a function's
        backward reaches the caller."""
        return self.sim is not None

    def drop(self, model: Any) -> None:
        """Give ``model``'s device memory back now, whatever cycles its hooks make."""
        for p in model.parameters():
            p.grad = None
        model.to_empty(device="meta")
        self.empty_cache()

    def ids(self, seq: int, batch: int | None = None) -> torch.Tensor:
        batch = self.size.batch if batch is None else batch
        g = torch.Generator().manual_seed(1)
        return torch.randint(0, self.size.vocab, (batch, seq), generator=g).to(self.device)

    # -- a step ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def clock(self) -> Iterator[list[float]]:
        """Seconds of the block, appended to the yielded list when it ends: the host's
        clock around it on a GPU (synchronised), the H100 model's on the simulated
        device."""
        out: list[float] = []
        if self._timing is None:
            self.sync()
            start = time.perf_counter()
            yield out
            self.sync()
            out.append(time.perf_counter() - start)
            return
        with self._timing.attach(self._timing.H100) as timeline:
            yield out
            self.sync()
        out.append(float(timeline.end))

    def step(
        self,
        model: Any,
        ids: torch.Tensor,
        context: Callable[[], Any],
        *,
        keep_grads: bool = False,
    ) -> Step:
        """One forward under ``context()`` and one backward; the gradients dropped after
        (as ``zero_grad(set_to_none=True)``) unless ``keep_grads``. No optimizer step:
        the H100 model's predictions have none."""
        ctx = context()
        stats = getattr(ctx, "stats", None)
        moved = stats.to_host_bytes if stats is not None else 0
        self.sync()
        before = self.allocated()
        collecting = gc.isenabled()
        gc.disable()  # a collection inside would time the Python heap, not the step
        try:
            with self.peaks.during() as peaks, self.clock() as seconds:
                with ctx:
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                del loss
        finally:
            if collecting:
                gc.enable()
        if not keep_grads:
            for p in model.parameters():
                p.grad = None
        # What is left is what something still refers to, not garbage a collection would
        # free: an activation of ``save_on_cpu``'s step was once left in a reference cycle
        # (dry run, 1 run in 3).
        gc.collect()
        return Step(
            seconds=seconds[0],
            before=before,
            allocated=peaks.allocated - before,
            held=peaks.reserved - before,
            after=self.allocated(),
            to_host=stats.to_host_bytes - moved if stats is not None else None,
        )

    def after_oom(self, before: int | None = None) -> dict[str, int]:
        """After a step that raised (out of memory, most often), its model dropped:
        saved-tensor hooks left pushed (a hook pushed in a forward pre-hook and popped in
        a forward hook that the failed forward never reached), popped, and the bytes still
        counted allocated beyond ``before`` (if given: nothing else on the device may be
        alive then). On the simulated device those bytes are in its allocator's count
        alone (tests/simdev/NOTES.md): it starts again from a new allocator, as a new
        process would."""
        popped = 0
        autograd = torch._C._autograd
        while autograd._top_saved_tensors_default_hooks(False) is not None:
            autograd._pop_saved_tensors_default_hooks()
            popped += 1
        self.empty_cache()
        out = {"hooks_left_pushed": popped}
        if before is not None:
            out["bytes_left_allocated"] = left = self.allocated() - before
            if left > 0 and self.sim is not None:
                from tests.simdev import device

                device._STATE.allocators = device._STATE.new_allocators()
        return out


# --- the ways of keeping activations ----------------------------------------------------

#: what the quick frontier compares; ``--full`` adds :data:`MORE_MODES`
MODES = ("none", "default", "max_overhead", "device_limit", "trl", "save_on_cpu")
MORE_MODES = ("trl class", "use_streams=False", "budget 0.75", "budget 0.50", "budget 0.25")
#: the modes whose gradients must be bit-identical to ``none``'s
LEAKFREE_GOALS = ("default", "max_overhead", "device_limit")


def trl_missing() -> str | None:
    """Why TRL's offloader cannot run here (None: it can)."""
    try:
        import trl.models.activation_offloading  # noqa: F401
    except Exception as e:
        return f"trl not importable ({type(e).__name__}: {e})"[:200]
    return None


def context(
    mode: str,
    model: Any,
    bench: Bench,
    *,
    limit: int | None = None,
    moved: int | None = None,
) -> Callable[[], Any]:
    """The context of one step of ``mode`` on ``model`` (its own: TRL's manager registers
    hooks on it). leakfree's managers are built as the H100 model's predictions build
    them (``OffloadActivations`` told the model's parameters), each with its own pinned
    budget (``bench.pinned``). ``limit``: ``device_limit``'s ceiling (absolute bytes);
    ``moved``: what the default moves per step (the ``budget`` modes). Raises
    :class:`Unavailable` with the reason where the mode cannot run."""
    if mode in ("none", "checkpoint"):
        return contextlib.nullcontext
    if mode == "save_on_cpu":
        return lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)
    if mode in ("trl", "trl class"):
        missing = trl_missing()
        if missing:
            raise Unavailable(missing)
        from trl.models import activation_offloading as trl_offload

        if mode == "trl class":  # a new one each step, as TRL's own usage
            return trl_offload.OffloadActivations
        trl_ctx = trl_offload.get_act_offloading_ctx_manager(model)
        return lambda: trl_ctx
    options: dict[str, Any] = {}
    if mode == "max_overhead":
        options["max_overhead"] = 0.05
    elif mode in ("device_limit", "device_limit=cap"):
        if limit is None:
            raise Unavailable("no limit: no allocator statistics, or none did not run")
        options["device_limit"] = limit
    elif mode.startswith("budget "):
        if not moved:
            raise Unavailable("what the default moves per step was not measured")
        options["device_budget"] = int(float(mode.split()[1]) * moved)
    elif mode == "use_streams=False":
        options["use_streams"] = False
    elif mode not in ("default", "checkpoint + leakfree"):
        raise ValueError(f"context(mode={mode!r}): unknown mode")
    ctx = leakfree.OffloadActivations(pin_memory_budget=bench.pinned, **options)
    ctx.update_model_params(model)
    return lambda: ctx


def under(none_held: int) -> int:
    """How far under none's held peak ``device_limit`` is set: 1 GiB (a fifth of it where
    that is less, at small sizes)."""
    return min(GiB, none_held // 5)
