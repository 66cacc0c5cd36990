"""Growth that stops is not a leak: the plateau rule (leakfree/diagnostics/plateau.py, its
settings in rule.py), and the verdict a watched run gets at its end over all its steps."""

from __future__ import annotations

import collections
import re
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import leakfree
from leakfree.diagnostics.plateau import MAX_POINTS, History, settled
from leakfree.diagnostics.rule import Rule
from leakfree.diagnostics.watch import Watch
from leakfree.testing import LeakError, assert_no_leak

RULE = Rule.of("test", "watching")
GREW_THEN_FLAT = re.compile(r"grew by (.+?) over steps (\d+)-(\d+), then flat for (\d+) steps")


def series(steps: int, grow: Callable[[int], float]) -> tuple[list[int], list[float]]:
    """Steps 4..steps (after the watching warm-up) and the bytes ``grow(step)``."""
    at = list(range(4, steps + 1))
    return at, [float(grow(s)) for s in at]


def test_a_store_that_filled_then_stayed_is_a_plateau_with_where_it_stopped() -> None:
    at, values = series(40, lambda s: 1000 * min(s, 16))
    plateau = settled(at, values, RULE, 64)
    assert plateau is not None
    assert (plateau.first, plateau.last, plateau.flat) == (4, 16, 24)
    assert GREW_THEN_FLAT.fullmatch(str(plateau)), str(plateau)


def test_a_steady_leak_never_is() -> None:
    at, values = series(160, lambda s: 4096 * s)
    assert settled(at, values, RULE, 64) is None


def test_a_leak_that_grows_every_n_steps_is_not_excused_by_its_pauses() -> None:
    # a block every 12 steps: 11 flat steps between rises, more than the window of 10
    at, values = series(160, lambda s: 50_000 * (s // 12))
    assert settled(at, values, RULE, 64) is None
    # it stopped at step 96 and was flat for 64 steps since (more than 3 pauses): it filled
    at, values = series(160, lambda s: 50_000 * (min(s, 96) // 12))
    plateau = settled(at, values, RULE, 64)
    assert plateau is not None and plateau.last == 96


def test_a_short_flat_stretch_after_a_long_fill_is_not_enough() -> None:
    # filled for 60 steps, flat for the last 14: under half of the time it grew
    at, values = series(74, lambda s: 1000 * min(s, 60))
    assert settled(at, values, RULE, 64) is None


def test_a_slow_leak_after_a_large_fill_still_grows() -> None:
    at, values = series(80, lambda s: 100_000 * min(s, 12) + 512 * s)
    assert settled(at, values, RULE, 64) is None


def test_noise_that_never_grew_says_nothing() -> None:
    gen = torch.Generator().manual_seed(0)
    noise = torch.randint(-8000, 8000, (200,), generator=gen).tolist()
    at, values = series(160, lambda s: 1_000_000 + noise[s])
    assert settled(at, values, RULE, 256) is None


def test_spikes_on_the_plateau_are_noise() -> None:
    spikes = {30: 9000, 45: -11000, 50: 7000}
    at, values = series(80, lambda s: 10_000 * min(s, 16) + spikes.get(s, 0) + 37 * (s % 3))
    plateau = settled(at, values, RULE, 256)
    assert plateau is not None and abs(plateau.last - 16) <= 1, plateau


def test_a_heap_that_creeps_after_the_fill_is_flat() -> None:
    """The heap's count of a bounded cache over 160 steps (as measured on the corpus's
    lru_cache control): it fills 1.7 KiB a step up to step 24, then creeps up by 150 B a
    step in all, a few jumps of 4 KiB among it (the interpreter's own): flat, filled at
    step 24."""
    jumps = {81: 3700, 97: 3500, 133: 4800}

    def heap(s: int) -> float:
        jumped = sum(j for at, j in jumps.items() if s >= at)
        return 1700 * min(s, 24) + 60 * max(s - 24, 0) + jumped

    at, values = series(160, heap)
    plateau = settled(at, values, RULE, 256)
    assert plateau is not None and abs(plateau.last - 24) <= 2, plateau


def test_a_history_keeps_the_whole_run_in_bounded_memory() -> None:
    history = History()
    for step in range(1, 5001):
        history.add(step, step)
    assert len(history) <= MAX_POINTS + 1
    assert history.at[0] == 1 and history.at[-1] == 5000
    assert list(history.at) == sorted(history.at) and history.values == history.at


def test_the_plateau_settings_are_checked_as_the_callers_arguments() -> None:
    with pytest.raises(ValueError, match=r"watch\(flat_pace=2\)"):
        Rule.of("watch", flat_pace=2)
    with pytest.raises(TypeError, match=r"watch\(flat_share='x'\)"):
        Rule.of("watch", flat_share="x")


def _watched(
    steps: int, store: collections.deque[torch.Tensor] | list[torch.Tensor]
) -> tuple[Watch, list[str]]:
    """A small loop under leakfree.watch() that keeps 8 KiB a step in ``store``."""
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    said: list[str] = []
    w = leakfree.watch(on_finding=lambda f: said.append(f.message))
    try:
        for _ in range(steps):
            model(torch.randn(4, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            store.append(torch.randn(2048))  # 8 KiB, no graph
    finally:
        w.stop()
    return w, said


def test_a_watched_buffer_that_filled_is_clean_at_the_end_and_says_so() -> None:
    w, said = _watched(48, collections.deque(maxlen=12))
    assert any("provisional" in m for m in said), said  # warned during the run, as such
    assert w.verdict == "clean" and w.findings == [], w.report()
    grown = GREW_THEN_FLAT.search(w.report())
    assert grown is not None, w.report()
    assert abs(int(grown[3]) - 12) <= 2 and int(grown[4]) >= 48 - 12 - 2, grown[0]
    assert "not a leak" in w.as_dict()["revisions"][0]


def test_a_watched_list_that_grows_to_the_end_is_a_leak_and_says_why() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w, _ = _watched(48, [])
    assert w.verdict == "leak", w.report()
    [why] = w.revisions
    assert "stands at the run's end" in why and "a leak" in why, why


def test_a_short_run_that_ends_filling_a_bounded_buffer_is_not_judged_and_says_why() -> None:
    w, said = _watched(16, collections.deque(maxlen=64))
    assert any("provisional" in m for m in said), said
    assert w.verdict == "not judged" and w.findings == [], w.report()
    why = w.as_dict()["not_judged_because"]
    assert "store (deque(maxlen=64)" in why or "(deque(maxlen=64)" in why, why


def test_a_short_run_whose_optimizer_makes_state_lazily_is_not_judged() -> None:
    """Layers unfrozen one at a time: the optimizer makes each one's state at its first
    update; the run ends while it still does."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))
    blocks.requires_grad_(False)
    opt = torch.optim.AdamW(blocks.parameters(), lr=1e-3)
    w = leakfree.watch(on_finding=lambda f: None)
    try:
        for step in range(16):
            if step % 3 == 0 and step // 3 < len(blocks):
                blocks[len(blocks) - 1 - step // 3].requires_grad_(True)
            x: torch.Tensor = torch.randn(8, 64)
            for block in blocks:
                x = block(x)
            x.square().mean().backward()  # type: ignore[no-untyped-call]
            opt.step()
            opt.zero_grad()
    finally:
        w.stop()
    assert w.verdict == "not judged" and w.findings == [], w.report()
    assert "optimizers made state" in w.as_dict()["not_judged_because"], w.report()


def test_a_check_that_stops_at_its_first_finding_does_not_call_it_provisional() -> None:
    """assert_no_leak raises at its first finding: nothing revises it, so it does not say
    it is provisional (a watch's finding does)."""
    kept: list[torch.Tensor] = []
    with pytest.raises(LeakError) as caught:
        assert_no_leak(lambda: kept.append(torch.randn(64, 64)), steps=8)
    assert "memory grows by" in str(caught.value)
    assert "provisional:" not in str(caught.value)
