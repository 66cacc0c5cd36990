"""The detector at its defaults: ``leakfree.watch()`` and ``assert_no_leak`` as a user calls
them, with no option changed.

A planted graph leak is found within the warm-up and one window of steps, memory kept per
microbatch is found in the first step, and what a clean loop keeps (a detached scalar
history, the last loss, a step's own input batches) raises no alarm."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import leakfree
from leakfree.diagnostics.watch import Watch
from leakfree.testing import assert_no_leak

VOCAB, BATCH, SEQ, MICRO = 1000, 2, 32, 4


@pytest.fixture
def quiet_warnings() -> Iterator[None]:
    """A finding warns MemoryGrowthWarning by default; the tests read ``w.findings``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def watched(
    steps: int, keep: Callable[[int, torch.Tensor], object], micro: int = 1, width: int = 64
) -> Watch:
    """``steps`` optimizer steps of ``micro`` backward passes of a linear model under
    ``leakfree.watch()`` at its defaults; ``keep(step, loss)`` after each backward."""
    torch.manual_seed(0)
    model = nn.Linear(width, width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    w = leakfree.watch()
    try:
        for step in range(1, steps + 1):
            for _ in range(micro):
                loss = model(torch.randn(8, width)).square().mean()
                loss.backward()
                keep(step, loss)
            opt.step()
            opt.zero_grad()
    finally:
        w.stop()
    return w


def test_watch_defaults_find_a_logged_loss_kept_with_its_graph_within_15_steps(
    quiet_warnings: None,
) -> None:
    kept_losses: list[torch.Tensor] = []
    # the default warm-up (3) + 12 steps; the leak: the loss with its graph, 4 B a step
    w = watched(15, lambda step, loss: kept_losses.append(loss))
    assert w.findings, w.report()
    wheres = [h.where for f in w.findings for h in f.holders]
    assert any("kept_losses" in where for where in wheres), w.report()


class Loop:
    """A training loop object that logs its loss detached and keeps the last loss (with its
    graph) for a later look: constant memory, no leak."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.history: list[torch.Tensor] = []
        self.prev_loss: torch.Tensor | None = None

    def step(self) -> None:
        loss = self.model(torch.randn(16, 32)).square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.history.append(loss.detach())  # 4 B a step: under the floor
        self.prev_loss = loss  # replaced every step: constant size


def test_assert_no_leak_defaults_accept_a_detached_history_and_the_last_loss() -> None:
    loop = Loop()
    assert_no_leak(loop.step)  # must not raise


def test_assert_no_leak_defaults_accept_the_last_loss_of_loops_kept_in_a_list() -> None:
    """The same loop over two seeds, the loops kept in a list: the first loop's last loss
    (a constant 4 B graph, reached through ``loops[0]``) is not what grows while the
    second runs (its detached history, 4 B a step, under the floor)."""
    loops = [Loop(seed) for seed in (0, 1)]
    for loop in loops:
        assert_no_leak(loop.step)  # must not raise (it named loops[0].prev_loss)


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def accumulate(keep: str, steps: int) -> Watch:
    """``steps`` optimizer steps of MICRO microbatches each under ``leakfree.watch()``; each
    microbatch keeps ``keep`` ("logits": its logits detached, 256 KiB; "loss": its loss
    detached; "inputs": nothing, the step's input batches live in a list made up front)
    in ``step_outputs``, cleared at the step's end."""
    torch.manual_seed(0)
    model = LM()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    w = leakfree.watch()
    try:
        for _ in range(steps):
            batches = [torch.randint(0, VOCAB, (BATCH, SEQ)) for _ in range(MICRO)]
            step_outputs: list[torch.Tensor] = []
            for ids in batches:
                logits = model(ids)
                loss = loss_fn(logits.view(-1, VOCAB), ids.view(-1)) / MICRO
                loss.backward()
                if keep == "logits":
                    step_outputs.append(logits.detach())  # 2 x 32 x 1000 floats: 256 KiB
                elif keep == "loss":
                    step_outputs.append(loss.detach())
            opt.step()
            opt.zero_grad()
            step_outputs.clear()  # the step's metrics, read and dropped
            del batches
    finally:
        w.stop()
    return w


def test_watch_defaults_find_detached_logits_kept_per_microbatch_in_step_1(
    quiet_warnings: None,
) -> None:
    w = accumulate("logits", steps=2)
    micro = [f for f in w.findings if f.kind == "microbatch"]
    assert micro, w.report()
    assert micro[0].step == 1, w.report()
    assert any("step_outputs" in h.where for h in micro[0].holders), w.report()


@pytest.mark.parametrize("keep", ["loss", "inputs"])
def test_watch_defaults_are_quiet_on_a_scalar_per_microbatch_or_the_steps_inputs(
    keep: str,
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", leakfree.MemoryGrowthWarning)
        w = accumulate(keep, steps=16)
    assert w.findings == [], w.report()


def test_a_leak_is_searched_a_few_times_per_run_not_every_step(
    quiet_warnings: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outputs kept per microbatch and never let go grow across steps: one finding (in
    step 1, what each microbatch keeps), and the holder searches (each walks every graph
    kept so far) back off instead of running after every backward of every step; so does
    the cost."""
    from leakfree.diagnostics.findings import Reporter

    searches = []
    search = Reporter.search
    watching: list[Any] = []

    def counted(self: Reporter, *args: object, **kwargs: object) -> object:
        searches.append(watching[0].steps)  # the step the search runs in
        return search(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Reporter, "search", counted)
    torch.manual_seed(0)
    model = LM()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    kept: list[torch.Tensor] = []
    w = leakfree.watch()
    watching.append(w)
    try:
        for _ in range(48):
            for _ in range(MICRO):
                ids = torch.randint(0, VOCAB, (BATCH, 4))
                logits = model(ids)
                logits.logsumexp(-1).mean().backward()
                kept.append(logits)  # with its graph, never dropped
            opt.step()
            opt.zero_grad()
    finally:
        w.stop()
    # Found in step 1, kept per microbatch with its graph past the step's end; not
    # reported again when it grows across steps.
    assert [f.kind for f in w.findings] == ["microbatch"], w.report()
    assert "kept[*]" in w.findings[0].message and w.findings[0].step == 1, w.report()
    # 48 steps x 4 backward passes: 192 boundaries. The searches come in episodes spaced
    # twice as far apart each time: the second half of the run has one.
    later = [s for s in searches if s >= 24]
    assert len(later) <= 5, str(searches)


def test_a_detached_kibibyte_per_step_is_found_within_the_warmup_and_12_steps(
    quiet_warnings: None,
) -> None:
    """No graph to point at: 1 KiB of detached activations kept per step, the smallest leak
    the defaults promise to report within the warm-up (3) and 12 steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stats: list[torch.Tensor] = []
    w = leakfree.watch()
    try:
        for _ in range(15):
            hidden = model[1](model[0](torch.randn(16, 64)))
            model[2](hidden).square().mean().backward()
            opt.step()
            opt.zero_grad()
            stats.append(hidden.detach()[0].clone())  # 256 floats: 1 KiB a step
    finally:
        w.stop()
    assert [f.kind for f in w.findings] == ["growth"], w.report()
    [held] = w.findings[0].holders
    assert held.where == "stats" and w.findings[0].bytes_per == 1024
    assert w.verdict == "leak"


def test_assert_no_leak_judges_even_four_steps() -> None:
    """Growth suspected at the last of four steps has no step left to confirm it in: the
    window it was suspected on is the verdict (it passed a 500 KiB-per-step leak)."""
    kept: list[torch.Tensor] = []
    with pytest.raises(leakfree.testing.LeakError, match="kept  6 tensor"):  # warm-up too
        assert_no_leak(lambda: kept.append(torch.randn(64, 64)), steps=4)


class Flat:
    """The tracker a detector reads in these tests: a CPU judged, no storage tracker."""

    judged = "cpu"
    storage_tracker = None


def test_a_suspicion_the_run_ends_too_soon_to_confirm_leaves_the_verdict_it_had(
    no_gc: None,
) -> None:
    """A clean run's heap drifts upward in its last steps: the suspicion is not confirmed
    before the run ends, and the run, judged over a full window before it, stays clean
    (it exited 78 under ``leakfree run --fail``, in 3 runs of 10)."""
    from leakfree.diagnostics.detector import Detector

    def run(flat: int) -> Detector:
        """``flat`` steps, then a heap that rises until growth is suspected: the end."""
        detector = Detector(Flat())
        heap = [1_000_000] * flat + [1_000_000 + 900 * i for i in range(1, 20)]
        for signal in heap:
            detector.step(None, None, signal)
            if detector.confirming:
                break
        assert detector.confirming
        detector.finish()
        return detector

    assert run(flat=14).verdict == "clean"  # 12 steps judged after the warm-up, then this
    short = run(flat=2)  # nothing judged before the suspicion
    assert short.verdict == "not judged" and "too soon to confirm" in short.why_not_judged()


def test_a_leak_that_starts_late_is_found_within_a_few_steps_of_its_start(
    quiet_warnings: None,
) -> None:
    """The heap suspects it; the steps followed exactly since say it grows (a fit over a
    window that also held the flat steps before it called it a one-off, and raised the
    heap's bar above the leak)."""
    kept: list[torch.Tensor] = []

    def late(step: int, loss: torch.Tensor) -> None:
        if step > 40:
            kept.append(torch.randn(64, 16))  # 4 KiB a step from step 41

    w = watched(60, late)
    [found] = w.findings
    assert 41 < found.step <= 52 and found.bytes_per == 4096, w.report()


def test_a_detached_scalar_history_is_judged_once_not_every_few_steps(
    quiet_warnings: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 B of losses a microbatch kept detached is growth under the floor: once judged so,
    growth at that pace is not suspected (and confirmed, and searched) again."""
    from leakfree.diagnostics.detector import Detector

    suspected: list[int] = []
    suspect = Detector._suspect

    def counted(self: Detector, *args: Any) -> None:
        suspected.append(self.steps)
        suspect(self, *args)

    monkeypatch.setattr(Detector, "_suspect", counted)
    history: list[torch.Tensor] = []  # kept for the run: 4 B a microbatch
    w = watched(64, lambda step, loss: history.append(loss.detach()), micro=MICRO, width=32)
    assert w.findings == [] and w.verdict == "clean", w.report()
    assert len(suspected) <= 2, suspected


def test_on_an_accelerator_every_step_is_judged_from_its_allocator(
    accelerator: torch.device, quiet_warnings: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same promises where the allocator is read (the simulated device without a GPU):
    a leak found within the warm-up and 12 steps, and what a step keeps per microbatch,
    with or without a graph, in its first step. Once what the microbatches keep is
    reported, the same pace starts no search again (each walks every graph kept: three
    walks a step for the rest of the run, before)."""
    from leakfree.diagnostics.findings import Reporter

    searches: list[int] = []
    search = Reporter.search
    watching: list[Any] = []

    def counted(self: Reporter, *args: object, **kwargs: object) -> object:
        searches.append(watching[0].steps)
        return search(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Reporter, "search", counted)
    torch.manual_seed(0)
    model = nn.Linear(64, 64).to(accelerator)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    kept: list[torch.Tensor] = []
    w = leakfree.watch()
    watching.append(w)
    try:
        assert w.device.type == accelerator.type
        for _ in range(15):  # the warm-up (3) and 12 steps
            outputs = []
            for _ in range(MICRO):
                out = model(torch.randn(8, 64, device=accelerator))
                out.square().mean().backward()
                outputs.append(out.detach())  # 2 KiB a microbatch, dropped at the step's end
            opt.step()
            opt.zero_grad()
            kept.append(torch.ones(256, device=accelerator))  # 1 KiB a step, kept
            del outputs
    finally:
        w.stop()
    kinds = {f.kind: f for f in w.findings}
    assert set(kinds) == {"microbatch", "growth"}, w.report()
    assert kinds["microbatch"].step == 1 and "outputs" in kinds["microbatch"].message
    assert kinds["growth"].bytes_per == 1024 and kinds["growth"].holders[0].where == "kept"
    assert len([s for s in searches if s >= 2]) <= 8, searches  # the growth's, a few


# --- each setting declared once, and two floors with two names ----------------------------------


def test_every_entry_point_takes_its_defaults_from_the_one_rule() -> None:
    """The settings and their defaults are the rule's; a context with other defaults names
    them in one table (they were declared again in five places, warm-ups of 2 and 3)."""
    from leakfree.cli.run import parser
    from leakfree.diagnostics.rule import CONTEXTS, Rule
    from leakfree.integrations._growth import GrowthWatch

    assert Rule.of("x") == Rule() and Rule().warmup == 2
    watching = Rule.of("watch", "watching")
    assert watching == Rule(**CONTEXTS["watching"]) and watching.warmup == 3
    growth = GrowthWatch("cb", warmup=None, window=None, tolerance=None, fail=False,
                         device="cpu", roots=None)  # fmt: skip
    assert growth.rule == watching
    text = parser("leakfree run").format_help()
    assert f"steps not judged across steps ({watching.warmup})" in text
    assert f"the recent steps judged ({watching.window})" in text
    assert Rule.of("watch", "watching", warmup=5).warmup == 5


def test_a_high_floor_for_detached_growth_does_not_hide_graphs_kept_per_microbatch() -> None:
    """``floor`` (bytes per step of growth without a graph) and ``graph_floor`` (bytes a
    microbatch's kept graph must hold) were one field: raising the first to accept a
    metrics history hid verl's entropy graphs, kept once per microbatch."""
    from leakfree.diagnostics.rule import Rule
    from tests.test_finders import model_and_opt, verl_update, watch

    model, opt = model_and_opt()
    loud = Rule(floor=1 << 30)
    [found] = watch(lambda: verl_update(model, opt, micro=4, detach=False), steps=3, rule=loud)
    assert found.kind == "microbatch"
    quiet = Rule(graph_floor=1 << 30)
    findings = watch(lambda: verl_update(model, opt, micro=4, detach=False), steps=3, rule=quiet)
    assert all(f.kind != "microbatch" for f in findings)


def test_outputs_kept_with_their_graph_per_microbatch_are_a_leak_in_a_two_step_run(
    quiet_warnings: None,
) -> None:
    """What each microbatch keeps is judged whether or not it outlives the step: logits
    kept with their graph from every microbatch, never let go, are a leak after two steps
    (no across-step verdict could be made in so few)."""
    torch.manual_seed(0)
    model = LM()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    epoch_logits: list[torch.Tensor] = []
    w = leakfree.watch()
    try:
        for _ in range(2):
            for _ in range(MICRO):
                ids = torch.randint(0, VOCAB, (BATCH, SEQ))
                logits = model(ids)
                logits.logsumexp(-1).mean().backward()
                epoch_logits.append(logits)  # with its graph, read at the epoch's end
            opt.step()
            opt.zero_grad()
    finally:
        w.stop()
    assert w.verdict == "leak", w.report()
    [found] = w.findings
    assert found.kind == "microbatch" and found.step == 1, w.report()
    assert [h.where for h in found.holders] == ["epoch_logits[*]"], w.report()
    assert "still held after the step ended" in found.message
