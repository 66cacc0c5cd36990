"""The leaks nobody had catalogued, each in the shape users hit it: the leaky version is
reported with its holder and the line that made it, the fixed one is quiet.

Every case runs a real loop under the real watchers (MemoryTracker, assert_no_leak): no
stand-ins. Sites are asserted as ``tests/test_finders.py:LINE in FUNCTION``; LINE comes
from :func:`line_of`, so editing this file does not break them.
"""

from __future__ import annotations

import functools
import gc
import importlib
import inspect
import itertools
import sys
import textwrap
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from leakfree import LossLog
from leakfree.diagnostics import Finding, MemoryTracker, Rule, find_retained
from leakfree.integrations import MemoryGrowthWarning
from leakfree.testing import LeakError, assert_no_leak
from tests.test_losses import ContextLoss

HERE = "tests/test_finders.py"


def line_of(fn: Callable[..., Any], text: str) -> int:
    """The line of ``fn``'s source that contains ``text``."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def watch(step: Callable[[], None], steps: int, **kw: Any) -> list[Finding]:
    """Run ``steps`` steps under an exact tracker; its findings (no warnings)."""
    tracker = MemoryTracker(devices=["cpu"], sample_every=1, warn=False, **kw)
    with tracker:
        for _ in range(steps):
            step()
            tracker.step()
    return tracker.findings


def model_and_opt(width: int = 32) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 16))
    return model, torch.optim.SGD(model.parameters(), lr=1e-2)


# --- retention per microbatch: verl's output_lst, Fast-LLM's context.losses -----------------


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    p = logits.softmax(-1)
    return -(p * p.log()).sum(-1)  # computed with grad, not part of the loss


def verl_update(model: nn.Module, opt: Any, micro: int, detach: bool) -> list[dict[str, Any]]:
    """verl's update_policy (#6698, #7166): per-microbatch metrics appended to output_lst."""
    output_lst = []
    for _ in range(micro):
        logits = model(torch.randn(8, 32))
        entropy = compute_entropy(logits)
        loss = logits.logsumexp(-1).mean() / micro
        loss.backward()
        output_lst.append({"entropy": entropy.detach() if detach else entropy})
    opt.step()
    opt.zero_grad()
    return output_lst


def test_verl_output_list_is_reported_in_the_first_step_with_holder_and_site() -> None:
    model, opt = model_and_opt()
    findings = watch(lambda: verl_update(model, opt, micro=4, detach=False), steps=3)
    [found] = findings
    assert found.kind == "microbatch" and found.step == 1  # in the first optimizer step
    line = line_of(compute_entropy, "return -(p * p.log())")
    site = f"created at {HERE}:{line} in compute_entropy"
    assert "output_lst[*]['entropy']  2 graphs" in found.message and site in found.message
    # each microbatch's entropy graph (p, log p saved: 2 x 8 x 16 floats) and more
    assert found.bytes_per >= 2 * 8 * 16 * 4
    assert "per backward pass" in found.message


def test_verl_shape_never_grows_across_steps_so_a_per_step_verdict_alone_misses_it() -> None:
    model, opt = model_and_opt()
    tracker = MemoryTracker(devices=["cpu"], sample_every=1, warn=False, microbatches=False)
    with tracker:
        for _ in range(14):
            verl_update(model, opt, micro=4, detach=False)
            tracker.step()
    assert not tracker.growth("cpu", skip=2).exceeds(0) and not tracker.findings


def test_verl_detached_metrics_are_quiet() -> None:
    model, opt = model_and_opt()
    assert watch(lambda: verl_update(model, opt, micro=4, detach=True), steps=14) == []


def test_assert_no_leak_raises_for_microbatch_retention_by_default() -> None:
    model, opt = model_and_opt()
    with pytest.raises(LeakError, match=r"(?s)kept per backward pass.*output_lst\[\*\]"):
        assert_no_leak(lambda: verl_update(model, opt, micro=3, detach=False), steps=4)
    assert_no_leak(lambda: verl_update(model, opt, micro=3, detach=True), steps=4)


class BatchContext:
    """Fast-LLM's BatchContext (#486): losses kept per microbatch until the step ends."""

    def __init__(self) -> None:
        self.losses: dict[str, list[torch.Tensor]] = {"lm": []}


def fast_llm_step(model: nn.Module, opt: Any, detach: bool) -> None:
    context = BatchContext()
    for _ in range(3):
        # The fused loss keeps its state on ctx (Fast-LLM's kernels, Transformer Engine):
        # a graph kept for logging keeps that state, 64 KiB a microbatch here.
        loss = ContextLoss.apply(model(torch.randn(8, 32)))
        loss.backward()
        context.losses["lm"].append(loss.detach() if detach else loss)
    opt.step()
    opt.zero_grad()


def test_fast_llm_context_losses() -> None:
    model, opt = model_and_opt()
    [found] = watch(lambda: fast_llm_step(model, opt, detach=False), steps=2)
    assert found.kind == "microbatch" and "context.losses['lm'][*]  2 graphs" in found.message
    assert "ContextLoss.ctx.context" in found.message  # and what they keep
    line = line_of(fast_llm_step, "loss = ContextLoss.apply(")
    assert f"created at {HERE}:{line} in fast_llm_step" in found.message
    assert found.bytes_per >= 64 * 1024 * 4
    assert watch(lambda: fast_llm_step(model, opt, detach=True), steps=14) == []


def test_backpropagated_scalar_losses_kept_until_the_step_ends_are_metrics() -> None:
    """torch.distributed.pipelining keeps each microbatch's loss, with its graph, until the
    step ends: once backpropagated it pins nothing but itself, 4 B: not a finding."""
    model, opt = model_and_opt()

    def step() -> None:
        losses = []
        for _ in range(4):
            loss = model(torch.randn(8, 32)).square().mean()
            loss.backward()
            losses.append(loss)
        opt.step()
        opt.zero_grad()

    assert watch(step, steps=14) == []


# --- the detector's rule: small leaks cannot hide, clean loops do not trip ------------------


def test_a_4_byte_graph_leak_is_caught_behind_a_bounded_fill() -> None:
    model, opt = model_and_opt()
    cache: list[torch.Tensor] = []  # a tokenizer cache: fills over five steps, then stays
    kept: list[torch.Tensor] = []

    def step(leak: bool) -> None:
        if len(cache) < 5:
            cache.append(torch.zeros(64 * 1024))  # 256 KiB per step while filling
        loss = model(torch.randn(8, 32)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if leak:
            kept.append(loss)  # 4 B per step, with its graph

    findings = watch(lambda: step(True), steps=2 + 5 + 20)
    assert findings and findings[0].kind == "growth"
    assert findings[0].step <= 2 + 5 + 20  # within 20 steps after the fill
    assert findings[0].bytes_per == 4 and "kept[*]" in findings[0].message
    kept.clear()
    cache.clear()
    assert watch(lambda: step(False), steps=2 + 5 + 20) == []


def test_detached_loss_history_under_the_floor_is_not_a_leak() -> None:
    model, opt = model_and_opt()
    history: list[torch.Tensor] = []

    def step() -> None:
        loss = model(torch.randn(8, 32)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        history.append(loss.detach())  # 4 B per step: a metric, not a leak

    growth = assert_no_leak(step, steps=20)
    assert growth.bytes_per_step == 4  # it grows, and is judged harmless
    with pytest.raises(LeakError, match="history"):
        assert_no_leak(step, steps=20, floor=2)  # the floor is the user's to set


def test_detached_growth_above_the_floor_names_its_holder() -> None:
    history: list[torch.Tensor] = []
    with pytest.raises(LeakError, match=r"history  \d+ tensor\(s\) without a graph"):
        assert_no_leak(lambda: history.append(torch.zeros(64)), steps=8)


# --- holders wherever they hide --------------------------------------------------------------

_HANDLE_CACHE_MODULE = """
import torch

_handle_cache = {}  # torchtitan #2296: cleared on one code path only


def all_gather(x, step, clean):
    out = torch.cat([x, x])
    _handle_cache[step] = out  # kept for a later wait() that never comes
    if clean:
        _handle_cache.clear()
    return out.sum()
"""


@pytest.fixture
def user_module(tmp_path: Path) -> Iterator[Any]:
    """A module of the user's own code, imported from a file (not a package)."""
    (tmp_path / "user_collectives.py").write_text(textwrap.dedent(_HANDLE_CACHE_MODULE))
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module("user_collectives")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("user_collectives", None)


def test_a_module_global_cache_is_named_from_the_module(user_module: Any) -> None:
    counter = iter(range(10**6))

    def step(clean: bool) -> None:
        user_module.all_gather(torch.randn(64), next(counter), clean)

    [found] = watch(lambda: step(False), steps=14)
    assert "user_collectives._handle_cache" in found.message
    assert "created at" in found.message and "user_collectives.py:8 in all_gather" in found.message
    assert watch(lambda: step(True), steps=14) == []


class Metrics:
    history: list[Any] = []  # a class attribute: shared, lives as long as the class


def test_a_class_attribute_holder() -> None:
    model, opt = model_and_opt()

    def step() -> None:
        loss = model(torch.randn(8, 32)).square().mean()
        loss.backward()
        Metrics.history.append(loss)

    try:
        [found] = watch(step, steps=14)
    finally:
        Metrics.history.clear()
    assert "Metrics.history[*]" in found.message


def test_hooks_registered_every_step_on_a_parameter() -> None:
    """pytorch #185331's lifetime: a hook added to a long-lived tensor every step keeps its
    closure (here the step's activation, with its graph) as long as the parameter."""
    model, opt = model_and_opt()

    def step(remove: bool) -> None:
        hidden = model[0](torch.randn(8, 32))
        handle = model[0].weight.register_hook(lambda g: g * hidden.detach().mean())
        model[2](model[1](hidden)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if remove:
            handle.remove()

    [found] = watch(lambda: step(False), steps=14)
    hooks = "model._modules['0']._parameters['weight']._backward_hooks[*]<closure>"
    assert hooks in found.message
    line = line_of(step, "hidden = model[0](")
    assert f"created at {HERE}:{line} in " in found.message
    assert watch(lambda: step(True), steps=14) == []


def test_graphs_kept_by_retain_graph_count_their_saved_tensors() -> None:
    model, opt = model_and_opt()
    later: list[torch.Tensor] = []

    def step() -> None:
        out = model(torch.randn(8, 32))
        out.square().mean().backward(retain_graph=True)  # "for a later backward"
        later.append(out)  # that never comes
        opt.step()
        opt.zero_grad()

    [found] = watch(step, steps=14)
    [held] = found.holders
    assert held.where == "later[*]" and held.count >= 6
    assert "retain_graph=True" in held.detail
    # the saved activations are alive and counted: far more than the 8 x 16 outputs
    assert held.nbytes / held.count > 4 * 8 * 16 * 4
    assert found.bytes_per > 4 * 8 * 16 * 4


class OffloadTable:
    """axolotl #3638's offloader: the table is reset only once every packed tensor was
    unpacked, and some saved tensors never are (a branch outside the loss)."""

    def __init__(self, reset_on_enter: bool) -> None:
        self.tracker: dict[int, torch.Tensor] = {}
        self.pending: set[int] = set()
        self.reset_on_enter = reset_on_enter
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> int:
        key = len(self.tracker)
        self.tracker[key] = t.detach().clone()  # the host copy
        self.pending.add(key)
        return key

    def unpack(self, key: int) -> torch.Tensor:
        out = self.tracker[key]
        self.pending.discard(key)
        if not self.pending:  # the cleanup that never fires: one is never unpacked
            self.tracker.clear()
        return out

    def __enter__(self) -> OffloadTable:
        if self.reset_on_enter:  # the fix (TRL 1.16's): a new step starts a new table
            self.tracker.clear()
            self.pending.clear()
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.hooks.__exit__(*exc)


def test_a_saved_tensor_hook_table_whose_cleanup_never_fires() -> None:
    model, opt = model_and_opt()

    def step(offloader: OffloadTable) -> None:
        with offloader:
            out = model(torch.randn(8, 32))
            side = out.sigmoid()  # saved, never unpacked: not in the loss
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
        del side

    leaky = OffloadTable(reset_on_enter=False)
    [found] = watch(lambda: step(leaky), steps=14)
    assert "leaky.tracker" in found.message and "without a graph" in found.message
    fixed = OffloadTable(reset_on_enter=True)
    assert watch(lambda: step(fixed), steps=14) == []


# --- gc switched off, or slow ----------------------------------------------------------------


class Node:
    def __init__(self, out: torch.Tensor) -> None:
        self.out = out
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture
def no_auto_gc() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
        gc.collect()


def cycle_step(model: nn.Module, opt: Any, collect: bool) -> None:
    out = model(torch.randn(8, 32)).tanh()
    out.square().mean().backward()
    opt.step()
    opt.zero_grad()
    Node(out)
    if collect:
        gc.collect()  # torchforge #209's fix: collect every step


def test_cycles_under_gc_disable_are_named_with_their_path(no_auto_gc: None) -> None:
    model, opt = model_and_opt()
    findings = watch(lambda: cycle_step(model, opt, collect=False), steps=14)
    [found] = findings
    assert found.kind == "cycles" and found.cycles is not None
    assert not found.cycles.gc_enabled
    assert "gc is disabled" in found.message and "gc.collect() would free" in found.message
    assert "cycle: Node.me -> Node; holds it by .out" in found.message
    line = line_of(cycle_step, "out = model(")
    assert f"created at {HERE}:{line} in cycle_step" in found.message
    assert found.cycles.nbytes >= 6 * 8 * 16 * 4
    assert watch(lambda: cycle_step(model, opt, collect=True), steps=14) == []


def test_cycles_that_outlive_a_step_with_gc_on_are_freed_late() -> None:
    model, opt = model_and_opt()
    thresholds = gc.get_threshold()
    gc.set_threshold(10**9)  # on, but slow: what a large heap's oldest generation sees
    try:
        findings = watch(lambda: cycle_step(model, opt, collect=False), steps=4)
    finally:
        gc.set_threshold(*thresholds)
        gc.collect()
    [found] = findings
    assert found.kind == "late cycles" and "freed late" in found.message
    assert "Node.me -> Node" in found.message


# --- quiet by default ------------------------------------------------------------------------


def test_find_retained_on_a_clean_loop_reports_nothing_unless_asked() -> None:
    model, opt = model_and_opt()
    batches = [torch.randn(8, 32) for _ in range(4)]
    log = LossLog(["lm"])
    for x in batches:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        log["lm"].append(loss)
    report = find_retained()
    assert not report and not report.detached and str(report).startswith("nothing retained")
    everything = find_retained(everything=True)
    assert [r.where for r in everything if r.kind == "graph"] == ["loss"]
    assert any(r.where == "batches" for r in everything.detached)


def test_a_clean_loop_with_accumulation_adamw_a_cache_and_losslog_is_quiet() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # its state appears in step 1
    cache: dict[int, torch.Tensor] = {}
    log = LossLog(["lm"])

    def step() -> None:
        for _i in range(3):
            key = len(cache) % 4
            if key not in cache:
                cache[key] = torch.randn(128)  # bounded: four entries at most
            loss = model(torch.randn(8, 32)).square().mean() / 3
            loss.backward()
            log["lm"].append(loss)
        opt.step()
        opt.zero_grad()
        log.reduce()

    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryGrowthWarning)
        growth = assert_no_leak(step, steps=20)
    assert growth.bytes_per_step == 0


def test_rule_arguments_are_checked_before_anything_runs() -> None:
    with pytest.raises(ValueError, match=r"Rule\(window=3\)"):
        Rule(window=3)  # refused where it is made, before a tracker gets it
    with pytest.raises(ValueError, match=r"assert_no_leak\(floor=-1\)"):
        assert_no_leak(lambda: None, floor=-1)
    with pytest.raises(TypeError, match=r"MemoryTracker\(warn='no'\)"):
        MemoryTracker(warn="no")  # type: ignore[arg-type]


def test_compile_warm_up_is_quiet() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    compiled = torch.compile(model, backend="aot_eager")  # no C++ compiler needed
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        for _ in range(2):
            compiled(torch.randn(8, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    assert watch(step, steps=14) == []


def _rebinding_loop(tracker: MemoryTracker) -> list[bool]:
    """A training loop that rebinds its batch every step: was each one freed at once?"""
    from torch.multiprocessing.reductions import StorageWeakRef

    model, opt = model_and_opt()
    freed = []
    with tracker:
        for _ in range(3):
            batch = torch.randn(256)
            ref = StorageWeakRef(batch.untyped_storage())
            verl_update(model, opt, micro=3, detach=False)  # searches: reads this frame
            tracker.step()
            batch = None
            freed.append(ref.expired())
    return freed


def test_watching_keeps_no_local_alive() -> None:
    """A search reads the locals of the frames on the stack; before Python 3.13 that
    caches a snapshot on each frame which would keep this loop's last batch alive after
    the loop rebinds it. The watcher empties what it read."""
    tracker = MemoryTracker(devices=["cpu"], sample_every=1, warn=False)
    assert _rebinding_loop(tracker) == [True, True, True]
    assert tracker.findings  # it did search


def stats_step(model: nn.Module, opt: Any, keep: Callable[[torch.Tensor], None]) -> None:
    """A training step that hands 128 B of detached statistics to ``keep``."""
    stats = model[0](torch.randn(8, 32)).detach().mean(0)
    keep(stats)
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()
    opt.zero_grad()


STATS_LINE = line_of(stats_step, "stats = model[0](")


def test_hooks_registered_every_step_on_a_graph_node() -> None:
    """A hook added every step to the parameter's gradient accumulator (the node DDP hooks
    once) keeps its closure as long as the node."""
    model, opt = model_and_opt()
    accumulator = model[0].weight.view_as(model[0].weight).grad_fn.next_functions[0][0]

    def keep(stats: torch.Tensor) -> None:
        accumulator.register_prehook(lambda grads: (stats.sum(), None)[1])

    [found] = watch(lambda: stats_step(model, opt, keep), steps=14)
    assert "accumulator<hooks>  8 tensor(s) without a graph" in found.message
    assert f"created at {HERE}:{STATS_LINE} in stats_step" in found.message


def test_a_holder_no_walk_can_see_still_gets_the_line_that_made_it() -> None:
    """Tensors kept by ``weakref.finalize`` arguments live in the standard library's
    registry, which no search walks: what grew is still named by the line that made it."""
    import weakref

    model, opt = model_and_opt()

    def keep(stats: torch.Tensor) -> None:
        weakref.finalize(model, print, stats)  # runs when the model dies: keeps stats

    try:
        [found] = watch(lambda: stats_step(model, opt, keep), steps=14)
    finally:
        for finalizer in list(weakref.finalize._registry):  # type: ignore[attr-defined]
            finalizer.detach()
    assert "no holder found" in found.message and "6 storage(s)" in found.message
    assert f"created at {HERE}:{STATS_LINE} in stats_step" in found.message


def test_the_gc_probe_reads_garbage_holding_dead_weak_proxies(no_auto_gc: None) -> None:
    """Lightning leaves cycles with ``weakref.proxy`` objects whose referent is gone:
    ``isinstance`` on them raises ReferenceError; the probe must read around them."""
    import weakref

    from leakfree.diagnostics.cycles import find_cycles

    class Owner:
        pass

    gc.collect()  # the garbage of earlier tests is not this test's
    gone = Owner()
    node = Node(torch.zeros(256))
    node.proxy = weakref.proxy(gone)  # type: ignore[attr-defined]
    del gone, node
    found = find_cycles()
    assert found is not None and found.nbytes >= 1024 and "Node.me -> Node" in found.path


def _watched_twice(model: nn.Module, opt: Any) -> weakref.ref[MemoryTracker]:
    tracker = MemoryTracker(devices=["cpu"], sample_every=1, warn=False, roots={"model": model})
    with tracker:
        for _ in range(3):
            fast_llm_step(model, opt, detach=True)
            tracker.step()
    assert_no_leak(lambda: fast_llm_step(model, opt, detach=True), steps=4)
    return weakref.ref(tracker)


def test_a_watcher_makes_no_reference_cycle(no_auto_gc: None) -> None:
    """With gc off, a cycle through the tracker would keep its roots (the step's closure:
    the model, the optimizer's state) alive after the watch: there is none."""
    model, opt = model_and_opt()
    alive = weakref.ref(model)
    watched = _watched_twice(model, opt)
    del model, opt
    assert watched() is None
    assert alive() is None  # freed by reference counting alone


#: pytorch #161186's shape: state registered in forward, cleaned up in backward, where an
#: early exit (checkpoint's stop-recomputation path) returns before the cleanup
_pending: dict[int, torch.Tensor] = {}
_keys = itertools.count()


class EarlyExit(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cleanup_in_finally: bool) -> torch.Tensor:
        ctx.key, ctx.finally_ = next(_keys), cleanup_in_finally
        _pending[ctx.key] = x.detach().clone()  # the state the cleanup should drop
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        try:
            if g.abs().sum() >= 0:  # the early exit: always taken here
                return g * 2, None
            _pending.pop(ctx.key, None)
            return g * 2, None
        finally:
            if ctx.finally_:  # the fix: the cleanup runs on every path
                _pending.pop(ctx.key, None)


def test_a_cleanup_an_early_exit_skips() -> None:
    model, opt = model_and_opt()

    def step(fixed: bool) -> None:
        EarlyExit.apply(model(torch.randn(8, 32)), fixed).square().mean().backward()
        opt.step()
        opt.zero_grad()

    try:
        [found] = watch(lambda: step(False), steps=14)
    finally:
        _pending.clear()
    assert "tests.test_finders._pending" in found.message
    assert (
        "created at tests/test_finders.py:" in found.message
        and "EarlyExit.forward" in found.message
    )
    assert watch(lambda: step(True), steps=14) == []


# --- holders Python reaches only indirectly, and the line whose result is kept --------------
#
# Each shape is one reported in 2024-2026 (the URL in its docstring), reduced to a CPU loop;
# the fixed form (the report's fix) is quiet. What makes each hard: the tensors are held by
# an object the walk used not to enter (an exception's traceback, a functools cache), or
# the object that holds them was allocated on one line and filled on another.


def inner_config(model: nn.Module, x: torch.Tensor) -> None:
    act = model(x).tanh()  # what the failed configuration computed before it raised
    raise RuntimeError(f"config failed ({act.shape})")


def test_exceptions_kept_with_their_tracebacks_name_the_frame_and_the_local() -> None:
    """pytorch/pytorch#188907, triton-lang/triton#11174 (2026): a caught exception kept
    (the last failed autotuning config) pins the frames of its traceback and their locals.
    The fix drops the traceback (``e.__traceback__ = None``) or the exception."""
    model, opt = model_and_opt()
    errors: list[BaseException] = []

    def step(fixed: bool) -> None:
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        try:
            inner_config(model, torch.randn(64, 32))
        except RuntimeError as e:
            errors.append(e.with_traceback(None) if fixed else e)

    [found] = watch(lambda: step(False), steps=14)
    assert "errors[*].__traceback__<frame inner_config>.act  8 graphs" in found.message
    line = line_of(inner_config, "act = model(x)")
    assert f"created at {HERE}:{line} in inner_config" in found.message
    errors.clear()
    assert watch(lambda: step(True), steps=14) == []


def test_a_functools_cache_of_tensors_is_named_with_its_entries() -> None:
    """meta-pytorch/torchtune#904 (2024), huggingface/transformers#45412 (2026): an
    ``lru_cache`` keyed by something that changes every call keeps every result. Cached
    anchors computed with grad keep their graphs; a bounded cache keeps at most its size."""
    import functools

    model, opt = model_and_opt()

    @functools.cache
    def anchors(n: int) -> torch.Tensor:
        return model(torch.full((16, 32), float(n)))

    @functools.lru_cache(maxsize=4)
    def bounded(n: int) -> torch.Tensor:
        return model(torch.full((16, 32), float(n)))

    calls = itertools.count(4)

    def step(cached: Callable[[int], torch.Tensor]) -> None:
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        cached(next(calls))  # a new key every step: a new entry every step

    [found] = watch(lambda: step(anchors), steps=14, roots={"anchors": anchors})
    assert "anchors<cache>[*]  8 graphs" in found.message
    assert f"created at {HERE}:{line_of(anchors, 'return model(')}" in found.message
    assert watch(lambda: step(bounded), steps=14, roots={"bounded": bounded}) == []


def test_module_hooks_registered_every_step_keep_what_their_closures_hold() -> None:
    """fffasttime/MRFI#5, cornellius-gp/gpytorch#2734 (2026): a hook registered every step
    with its handle dropped keeps what it captured as long as the module."""
    model, opt = model_and_opt()

    def step(fixed: bool) -> None:
        hidden = model[0](torch.randn(8, 32))
        handle = model[0].register_forward_hook(lambda m, i, o, hidden=hidden: None)
        hidden.square().mean().backward()
        opt.step()
        opt.zero_grad()
        if fixed:
            handle.remove()

    [found] = watch(lambda: step(False), steps=14, roots={"model": model})
    assert "model._modules['0']._forward_hooks[*]<default 0>  8 graphs" in found.message
    assert watch(lambda: step(True), steps=14, roots={"model": model}) == []


def test_an_eval_total_accumulated_in_place_is_named_at_the_line_that_accumulates() -> None:
    """The validation loop that sums its losses as tensors outside ``torch.no_grad()``
    (verl-project/verl#6699, pnnl/neuromancer#292, 2026): every step's graph and its saved
    activations hang off the running total. The total was allocated on one line and grows
    on another: the line named is the one whose result is kept, the accumulation."""
    model, opt = model_and_opt(width=32)
    metrics: dict[str, torch.Tensor] = {}

    def step(fixed: bool) -> None:
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if "val" not in metrics:
            metrics["val"] = torch.zeros(())  # the buffer: allocated once, here
        val = model(torch.randn(64, 32)).square().mean()  # no torch.no_grad(): a graph
        metrics["val"] += val.detach() if fixed else val  # what it holds: made here

    [found] = watch(lambda: step(False), steps=14, roots={"metrics": metrics})
    assert found.holders[0].where == "metrics['val']" and "graph" in found.message
    accumulates = line_of(step, 'metrics["val"] +=')
    assert f"created at {HERE}:{accumulates} in " in found.message
    metrics.clear()
    assert watch(lambda: step(True), steps=14, roots={"metrics": metrics}) == []


def test_a_running_total_chained_through_its_graph_is_found_on_the_heap() -> None:
    """ray-project/ray#40940 and the training loops that sum ``total_loss += loss`` after
    ``loss.backward()``: the saved tensors are freed, so no tensor storage grows, but each
    step's autograd nodes hang off the next (host memory, every step). The default mode
    reads the C heap at every step and sees it; the holder gains nodes every step."""
    from leakfree.diagnostics.heap import heap_counter

    if heap_counter() is None:
        pytest.skip("no heap count here (not glibc): only tensor storages are followed")
    model, opt = model_and_opt(width=64)

    class Meter:
        def __init__(self) -> None:
            self.total = torch.zeros(())

    meter = Meter()

    def run(fixed: bool) -> list[Finding]:
        tracker = MemoryTracker(devices=["cpu"], warn=False, roots={"meter": meter})
        with tracker:
            for _ in range(24):
                loss = model(torch.randn(16, 64)).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                meter.total += loss.detach() if fixed else loss
                tracker.step()
        return tracker.findings

    [found] = run(False)
    assert "autograd graphs grow step after step" in found.message
    assert "meter.total  graph" in found.message and "autograd nodes per step" in found.message
    meter.total = torch.zeros(())
    assert run(True) == []


def test_reading_a_kept_exceptions_frames_keeps_none_of_their_locals(no_gc: None) -> None:
    """The frame that caught a kept exception is often the training loop itself, still
    running: reading its locals (before Python 3.13) caches a snapshot on the frame that
    would keep every output it rebinds alive until the loop returns. The search reads it
    and lets it go, as it does for the frames on the stack."""
    model, opt = model_and_opt()
    errors: list[BaseException] = []
    outputs: list[weakref.ref[torch.Tensor]] = []

    def train() -> None:
        tracker = MemoryTracker(devices=["cpu"], sample_every=1, warn=False)
        with tracker:
            for step in range(12):
                try:
                    if step == 0:
                        raise ValueError("a skipped batch, kept for the summary")
                except ValueError as e:
                    errors.append(e)
                out = model(torch.randn(8, 32))
                outputs.append(weakref.ref(out))
                out.square().mean().backward()
                opt.step()
                opt.zero_grad()
                tracker.step()
                if step == 4:
                    find_retained(errors, names=["errors"])  # reads this frame's locals
        del out
        assert [r for r in outputs if r() is not None] == []  # all freed, train() running

    train()


# --- holders a walk from the roots used not to reach, and every holder of a tensor --------
#
# The held-out corpus's shapes (tests/integration/corpus/), reduced to a few lines: a cache
# inside a C-implemented wrapper on a class, attributes a removed hook set on a module kept
# in a list, a cycle through a Function's ctx under gc.disable(), a tensor held twice.


class SpeechItems:
    """MoonshotAI/Kimi-Audio#117 (2025): ``lru_cache`` on a dataset's ``__getitem__``."""

    def __init__(self, cached: bool) -> None:
        self.waves = torch.randn(64, 32)
        self.cached = cached

    def read(self, i: int) -> dict[str, torch.Tensor]:
        return self.__getitem__(i) if self.cached else self.plain(i)

    @functools.lru_cache(maxsize=None)  # noqa: B019, UP033 (the report's code)
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.plain(i)

    def plain(self, i: int) -> dict[str, torch.Tensor]:
        return {"features": torch.log1p(self.waves[i].abs() * 2)}


class CachedWindow:
    """sktime/pytorch-forecasting#1905 (2025): ``@property`` over ``@functools.cache``."""

    def __init__(self, series: torch.Tensor, start: int) -> None:
        self.series = series
        self.start = start

    @property
    @functools.cache  # noqa: B019 (the report's code)
    def features(self) -> torch.Tensor:
        x = self.series[self.start : self.start + 8]
        return x - x.mean(0)


class HookedExplainer:
    """jmschrei/tangermeme#84 (2026): forward hooks set ``module.input`` and are removed;
    the attributes stay, on a module each explainer makes."""

    def __init__(self, model: nn.Module, clear: bool) -> None:
        self.model = model
        self.softmax = nn.Softmax(dim=-1)
        self.clear = clear

    def _keep_io(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        module.input = inputs[0].clone().detach()

    def attribute(self, x: torch.Tensor) -> torch.Tensor:
        handle = self.softmax.register_forward_hook(self._keep_io)
        probs = self.softmax(self.model(x)).detach()
        handle.remove()
        if self.clear:
            del self.softmax.input  # the upstream fix
        return probs


def train_step(model: nn.Module, opt: Any) -> None:
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_an_lru_cache_on_getitem_is_named_by_its_class() -> None:
    """The cache lives in the C wrapper on the class, under a dunder name: reached from
    the dataset, through its class."""
    model, opt = model_and_opt()
    reads = itertools.count()

    def step(data: SpeechItems) -> None:
        train_step(model, opt)
        data.read(next(reads))  # a new item every step, as an epoch reads them

    data = SpeechItems(cached=True)
    [found] = watch(lambda: step(data), steps=14, roots={"data": data})
    assert "SpeechItems.__getitem__<cache>[<tuple>]['features']  " in found.message
    assert f"in {HERE}" not in found.message  # the holder is named, not a lone line
    assert f"{HERE}:{line_of(SpeechItems.plain, 'log1p')} in SpeechItems.plain" in found.message
    SpeechItems.__getitem__.cache_clear()
    plain = SpeechItems(cached=False)
    assert watch(lambda: step(plain), steps=14, roots={"data": plain}) == []


def test_a_functools_cache_under_a_property_is_named_by_the_property() -> None:
    model, opt = model_and_opt()
    series = torch.randn(256, 4)
    starts = itertools.count()

    def step() -> None:
        train_step(model, opt)
        window = CachedWindow(series, next(starts))
        window.features.sum()  # a window per step, and the cache keeps each

    [found] = watch(step, steps=14)
    assert "CachedWindow.features<cache>  " in found.message
    CachedWindow.features.fget.cache_clear()  # type: ignore[attr-defined]


def test_attributes_a_removed_forward_hook_set_are_named_with_the_hook() -> None:
    model, opt = model_and_opt()
    probe = torch.randn(4, 32)

    def step(reports: list[dict[str, Any]], clear: bool) -> None:
        train_step(model, opt)
        explainer = HookedExplainer(model, clear)
        reports.append({"top": explainer.attribute(probe).argmax().item(), "explainer": explainer})

    reports: list[dict[str, Any]] = []
    [found] = watch(lambda: step(reports, False), steps=14, roots={"reports": reports})
    line = found.message.splitlines()[-1]
    assert line.startswith("  reports[*]['explainer'].softmax.input  "), line
    assert "by the forward hook HookedExplainer._keep_io: removing the hook" in line
    fixed: list[dict[str, Any]] = []
    assert watch(lambda: step(fixed, True), steps=14, roots={"reports": fixed}) == []


class Utterance:
    """sktime/pytorch-forecasting#1905's fix where the instances live for the run:
    ``cached_property`` keeps each one's features as long as the dataset keeps it."""

    def __init__(self, wave: torch.Tensor) -> None:
        self.wave = wave

    @functools.cached_property
    def features(self) -> torch.Tensor:
        return torch.log1p(self.wave.abs())


def test_a_field_of_a_containers_items_is_named_apart_from_their_other_fields() -> None:
    """The waves a dataset was built with do not grow; the features read since do."""
    model, opt = model_and_opt()
    waves = torch.randn(64, 32)
    utterances = [Utterance(waves[i]) for i in range(64)]
    reads = itertools.count()

    def step() -> None:
        train_step(model, opt)
        utterances[next(reads)].features.sum()

    [found] = watch(step, steps=14, roots={"utterances": utterances})
    assert "\n  utterances[*].features  " in found.message
    assert ".wave" not in found.message


class Pinned(torch.autograd.Function):
    """NVIDIA/warp#675 (2025): forward returns what it computed and keeps it on ctx:
    node -> ctx -> tensor -> grad_fn -> node, a cycle only the collector frees."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        forces = -2 * x
        ctx.forces = forces
        return x.square().sum(), forces

    @staticmethod
    def backward(ctx: Any, grad_e: torch.Tensor, grad_f: torch.Tensor) -> torch.Tensor:
        return -grad_e * ctx.forces - 2 * grad_f


def test_a_cycle_through_a_functions_ctx_is_named_as_its_ctx_attribute(
    no_auto_gc: None,
) -> None:
    model, opt = model_and_opt()

    def step() -> None:
        energy, forces = Pinned.apply(model(torch.randn(8, 32)))
        (energy + forces.mean()).backward()
        opt.step()
        opt.zero_grad()

    [found] = watch(step, steps=14)
    assert found.kind == "cycles" and "gc is disabled" in found.message
    assert "cycle: Pinned.ctx.forces -> Tensor.grad_fn -> Pinned.ctx" in found.message
    assert "ctx.save_for_backward keeps it without a cycle" in found.message


def test_a_tensor_held_from_two_places_names_both_holders() -> None:
    """A schedule's internal list and the user's both hold each loss (torch's pipelining
    hands its losses over that way): each holder is named, the graph walked once."""
    model, opt = model_and_opt()
    kept: list[torch.Tensor] = []
    for _ in range(3):
        loss = model(torch.randn(8, 32)).square().mean()
        loss.backward()
        kept.append(loss)
    mine = list(kept)
    report = find_retained(kept, mine, names=["kept", "mine"])
    wheres = sorted(r.where for r in report if r.kind == "graph")
    assert wheres == [f"{name}[{i}]" for name in ("kept", "mine") for i in range(3)]
    first = {r.where: r for r in report}
    assert first["kept[0]"].nbytes == first["mine[0]"].nbytes > 0  # each pins the graph
    twice = find_retained([kept[0], kept[0]], names=["same"])  # one holder, listed once
    assert len([r for r in twice if r.kind == "graph"]) == 1
    opt.zero_grad()


class HandingSchedule:
    """torch.distributed.pipelining's schedules: each microbatch's loss kept in
    ``_internal_losses`` until the step ends, then handed to the caller's ``losses``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._internal_losses: list[torch.Tensor] = []

    def fill(self, micro: int) -> None:
        for _ in range(micro):
            loss = ContextLoss.apply(self.model(torch.randn(8, 32)))
            loss.backward()
            self._internal_losses.append(loss)

    def hand_over(self, losses: list[torch.Tensor]) -> None:
        losses.clear()
        losses.extend(self._internal_losses)
        self._internal_losses.clear()


def test_graphs_handed_to_another_holder_name_that_holder_too() -> None:
    """A finding named the schedule's list, filled within the step; a later search finds
    the caller's list keeping the same graphs (until the next step's end): named too."""
    from leakfree.diagnostics.findings import Reporter

    model, opt = model_and_opt()
    schedule = HandingSchedule(model)
    losses: list[torch.Tensor] = []
    roots = {"schedule": schedule, "losses": losses}
    tracker = MemoryTracker(devices=["cpu"], sample_every=1, warn=False)
    reporter = Reporter(tracker, owner="watch", roots=roots, on_finding=None)
    schedule.fill(micro=3)
    graphs = [i for i in reporter.search(None, everything=True) if i.kind == "graph"]
    reporter.found("microbatch", graphs, 1.0, "watch: kept per backward pass:", step=1)
    assert "schedule._internal_losses[*]  3 graphs" in reporter.findings[0].message
    reporter.search(None, everything=True)
    assert len(reporter.findings) == 1  # nothing handed over yet
    schedule.hand_over(losses)
    reporter.search(None, everything=True)
    [_, also] = reporter.findings
    assert also.kind == "microbatch" and "\n  losses[*]  3 graphs" in also.message
    assert "the graphs schedule._internal_losses[*] held (kept per backward pass" in also.message
    reporter.search(None, everything=True)
    assert len(reporter.findings) == 2  # once
    opt.zero_grad()
