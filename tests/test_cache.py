"""A leak told from the allocator's cache (leakfree/diagnostics/cache.py), on the simulated
accelerator: its caching allocator splits, caches and gives back segments as CUDA's does
(tests/simdev/allocator.py), so what a step allocates and what it reserves part ways as
they do on a GPU."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from leakfree.diagnostics import MemoryTracker, Rule
from leakfree.diagnostics.cache import AllocatorGrowth
from tests.simdev.fragmentation import MiB, growing_steps

STEPS = 16


def _tracker(device: torch.device) -> MemoryTracker:
    return MemoryTracker(devices=[device], warn=False, rule=Rule(warmup=2, window=8))


def test_growing_shapes_are_the_cache_growing_not_a_leak(sim: Any) -> None:
    """Each step's temporary is larger than any cached block: the device reserves a new
    segment every step, while no tensor outlives its step."""
    tracker = _tracker(sim.device)
    pattern = growing_steps(sim.device, STEPS)
    with warnings.catch_warnings(), tracker:
        warnings.simplefilter("error")
        for _ in pattern:
            tracker.step()
    assert tracker.findings == []  # what tensors hold is flat: nothing to name
    verdict = tracker.allocator_verdicts()[str(sim.device)]
    assert verdict.kind == "cache", verdict
    # steps 2..15 each reserved a new segment of (20 + 2i) MiB
    assert verdict.cached == sum(20 + 2 * i for i in range(3, STEPS)) * MiB
    assert verdict.allocated == 0 and verdict.split == 0
    assert "not a leak" in verdict.message and "expandable_segments:True" in verdict.message
    assert "empty_cache()` gives back about" in verdict.message
    assert verdict.message in tracker.report()
    # what it says empty_cache gives back, it gives back
    before = sim.reserved()
    sim.module.empty_cache()
    assert before - sim.reserved() >= verdict.cached
    pattern.close()


def test_a_kept_tensor_is_a_leak_and_the_cache_is_flat(sim: Any) -> None:
    tracker = _tracker(sim.device)
    kept = []
    with warnings.catch_warnings(), tracker:
        warnings.simplefilter("ignore")
        for _ in range(STEPS):
            kept.append(torch.empty(MiB, dtype=torch.uint8, device=sim.device))  # 1 MiB a step
            tracker.step()
    verdict = tracker.allocator_verdicts()[str(sim.device)]
    assert verdict.kind == "leak", verdict
    assert verdict.allocated == (STEPS - 3) * MiB
    assert "a leak" in verdict.message and "empty_cache" not in verdict.message
    assert tracker.findings  # and the detector names it
    del kept


def test_a_flat_run_says_nothing_of_the_cache(sim: Any) -> None:
    tracker = _tracker(sim.device)
    with tracker:
        for _ in range(STEPS):
            x = torch.ones(1024, device=sim.device) * 2
            del x
            tracker.step()
    assert tracker.allocator_verdicts()[str(sim.device)].kind == "none"
    assert "cache" not in tracker.report()


def test_a_device_without_an_allocator_and_a_short_run_get_no_verdict(sim: Any) -> None:
    cpu = MemoryTracker(devices=["cpu"], warn=False)
    assert cpu.allocators == {}
    growth = AllocatorGrowth(sim.device)
    growth.step()
    assert growth.verdict(0) is None  # one reading: nothing grew or did not


def test_a_long_run_keeps_a_bounded_number_of_readings(sim: Any) -> None:
    growth = AllocatorGrowth(sim.device)
    for _ in range(1000):
        growth.step()
    assert len(growth.readings) <= 256 + 1 and growth.at[0] == 0
    assert growth.at == sorted(growth.at)


def test_free_space_live_tensors_split_is_fragmentation_which_empty_cache_cannot_return() -> None:
    """Counts as a device reports them (no device needed): the cache grew by 100 MiB, 60 of
    them free space inside segments that live tensors split."""
    from leakfree._allocator import Counts

    readings = iter(
        [
            Counts(10 * MiB, 20 * MiB, 0, 0, 0, 2 * MiB),
            Counts(10 * MiB, 120 * MiB, 0, 0, 0, 62 * MiB),
        ]
    )
    growth = AllocatorGrowth(torch.device("cpu"), read=lambda: next(readings))
    growth.step()
    growth.step()
    verdict = growth.verdict(0)
    assert verdict is not None and verdict.kind == "cache"
    assert (verdict.cached, verdict.split) == (100 * MiB, 60 * MiB)
    assert "gives back about 40.0 MiB" in verdict.message
    assert "60.0 MiB of it is free space in segments live tensors split" in verdict.message
