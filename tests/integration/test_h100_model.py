"""The H100 timing model against the H100 run, and the offload targets it predicts.

The H100 run's Llama (bf16, hidden 2048, 8 layers; each table with its own intermediate
size and batch) runs dry on the simulated device (``tests/simdev/predict.py``): shapes
only, every kernel and copy timed by ``tests/simdev/timing.py``'s H100 model. One rate
is fitted, the FLOP rate, on the steps without offloading of the first two tables
(``tests/simdev/calibration.py``: ``FITTED``); every other row is held out.

Tolerances, stated before the fit (from the errors of the model as it stood):

* fitted rows: the step time within 5% (the two rows disagree by 6% between themselves:
  the first table's larger model was measured faster, so no one rate fits both better
  than about 3% each);
* held-out rows: the ratio to the table's step without offloading within 15%; the
  activation peak within 7%, except the GPU suite's ``device_budget`` row, within 12%
  (its budget was half of what a fresh model's first step moved, and today's offloader's
  first step measures and moves everything, which e7732f1's did not: what that step
  moved on the GPU was not recorded); the bytes sent to the host within 3%.

Every leakfree row runs the offloader as the H100 run measured it
(:func:`predict.as_measured`: its streams, its window and its ``record_stream``), not
today's: the model is judged on the code it is compared with (replayed on the tree the
rows were first fitted on, 04feecc, the errors are the same to the digit).

The rest checks targets of the plan against the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.simdev import calibration as fit
from tests.simdev import predict as h100
from tests.simdev import timing

pytest.importorskip("transformers")

GiB = 1 << 30
FITTED_STEP, RATIO, ACTIVATION, TO_HOST = 0.05, 0.15, 0.07, 0.03
#: the one held-out row with a wider activation tolerance, and why (module docstring)
UNCERTAIN = {("suite", "offload_model budget 0.50"): 0.12}


@pytest.fixture(scope="module")
def dry() -> Iterator[Any]:
    if not h100._device.supported():
        pytest.skip("the simulated device needs its supported torch")
    with h100.dry_device() as sim:
        yield sim


@pytest.fixture(scope="module")
def calibrated(dry: Any) -> dict[tuple[str, str], h100.Prediction]:
    return fit.calibration(dry, trl=_has_trl())


def test_the_flop_rate_is_fitted_on_the_fitted_rows(
    calibrated: dict[tuple[str, str], h100.Prediction],
) -> None:
    found = fit.errors(calibrated)
    assert fit.fit_flops(calibrated) == pytest.approx(timing.H100.flops, rel=0.01)
    for e in found:
        if e.fitted:
            assert e.step_error is not None and abs(e.step_error) <= FITTED_STEP, fit.report(found)


def test_the_held_out_rows_are_within_the_stated_tolerances(
    calibrated: dict[tuple[str, str], h100.Prediction],
) -> None:
    found = fit.errors(calibrated)
    report = fit.report(found)
    held = [e for e in found if not e.fitted]
    assert len(held) == len(calibrated) - len(fit.FITTED)
    for e in held:
        key = (e.table, e.mode)
        if e.ratio_error is not None:
            assert abs(e.ratio_error) <= RATIO, (key, report)
        if e.activation_error is not None:
            assert abs(e.activation_error) <= UNCERTAIN.get(key, ACTIVATION), (key, report)
        if e.to_host_error is not None:
            assert abs(e.to_host_error) <= TO_HOST, (key, report)


@pytest.fixture(scope="module")
def held(dry: Any) -> dict[str, Any]:
    """Steps at 4096 tokens of no offloading, the default and the goals (a time cap, and a
    ceiling 1 GiB under what no offloading holds), on fresh models; the ceiling, beyond
    what the device held before a step."""
    none: dict[int, float] = {}
    out: dict[str, Any] = {"none": h100.steps(dry, "none", [4096], none=none)}
    ceiling = out["none"][0].held_peak - GiB
    params = out["params"] = _params(dry)
    out["ceiling"] = ceiling
    out["default"] = h100.steps(dry, "default", [4096] * 3, none=none)
    out["max_overhead"] = h100.steps(dry, "max_overhead=0.05", [4096] * 3, none=none)
    limit = f"device_limit={params + ceiling}"
    out["device_limit"] = h100.steps(dry, limit, [4096] * 6, none=none)
    out["device_limit cycling"] = h100.steps(dry, limit, [4096, 3584, 3072] * 2, none=none)
    return out


def _params(sim: Any) -> int:
    sim.module.empty_cache()
    model = h100.llama(sim.device)
    params = int(sim.allocated())
    model.to_empty(device="meta")
    sim.module.empty_cache()
    return params


def _lower(held: dict[str, Any], mode: str) -> float:
    return 1 - held[mode][-1].held_peak / held["none"][0].held_peak


def test_the_default_holds_40_percent_less_than_no_offloading_within_2_6x(
    held: dict[str, Any],
) -> None:
    """What the device holds (reserved), not only what it counts allocated: moved tensors
    leave in stream order, so their memory is reused while the forward runs (let go with
    ``record_stream``, it was held until the host saw the copies end: 43% *more* than no
    offloading, before)."""
    last = held["default"][-1]
    assert last.ratio <= 2.6 and _lower(held, "default") >= 0.40


def test_a_five_percent_time_cap_holds_less_within_7_percent(held: dict[str, Any]) -> None:
    """The target was 15% less held: the forward's link (25 ms at 55 GB/s, about 1.3 GiB)
    bounds what can leave the device before the step's peak, as it ends, without waiting:
    about 14% of what no offloading holds, less the allocator's spare. The plan's own
    prediction of what it holds is the model's, within 5%."""
    last = held["max_overhead"][-1]
    assert last.ratio <= 1.07 and _lower(held, "max_overhead") > 0.02
    plan = last.plan
    assert plan.mode.value == "max_overhead" and plan.overhead <= 0.05
    # what the plan predicts the device holds, after the step that checked it: the first
    # prediction was short by 10% (what the copies still running as the forward ends keep
    # from the allocator at backward's first large allocations); the check set it to what
    # the checking step held (within a 16th), which the next steps pass by up to 5%
    assert plan.measured_held is not None
    assert plan.held - held["params"] == pytest.approx(last.held_peak, rel=0.06)


def test_a_ceiling_1_gib_under_what_no_offloading_holds_is_held_every_step(
    held: dict[str, Any],
) -> None:
    """Every step holds under the ceiling: the measured one (it moves everything), each
    check, the corrections. The plan keeps a 16th of the limit under it (the caching
    allocator's blocks of a plan that moves less are laid out otherwise; a plan that
    cut it finer passed the limit by 0.17 GiB on a later step): 1.37x, where 1.15x was
    the target (1.61x before the first planned step prefetched and the search was
    coarse-then-fine)."""
    ceiling = held["ceiling"]
    assert all(s.held_peak <= ceiling for s in held["device_limit"])
    assert held["device_limit"][-1].ratio <= 1.45


def test_lengths_that_change_every_step_stay_under_the_ceiling(held: dict[str, Any]) -> None:
    ceiling = held["ceiling"]
    steps = held["device_limit cycling"]
    assert all(s.held_peak <= ceiling for s in steps), [s.held_peak / ceiling for s in steps]
    assert all(s.to_host > 0 for s in steps[1:])  # it follows its plan at every length


def test_under_the_cap_no_offloading_needs_a_ceiling_trains_1_75x_the_length(dry: Any) -> None:
    """The fit target: under what no offloading holds at 2 x 4096 (a hard cap, as
    ``set_per_process_memory_fraction``), ``device_limit`` at that cap trains 2 x 7168;
    no offloading does not train 2 x 4608 there (the cap binds)."""
    from tests.simdev import fit as fitting

    cap = fitting.caps(dry)[0]
    assert fitting.trains(dry, "none", cap=cap, batch=2, seq=4608) is None
    assert fitting.trains(dry, "device_limit=cap", cap=cap, batch=2, seq=7168) is not None


def test_a_time_cap_holds_on_the_h100_model_when_the_second_direction_runs_at_44_percent(
    dry: Any,
) -> None:
    """The probe measures both directions at once, the plan schedules with it, and the
    check corrects what is left: within 7% of the step (1.045x, predicted)."""
    import contextlib
    import dataclasses

    import torch

    rates = dataclasses.replace(timing.H100, duplex=0.44)
    model = h100.llama(dry.device)
    ids = torch.zeros(2, 4096, dtype=torch.long, device=dry.device)
    try:
        with timing.attach(rates) as plain:
            h100._step(dry, model, ids, contextlib.nullcontext)
        dry.module.empty_cache()
        context = h100._context("max_overhead=0.05", model, None)
        for _ in range(4):
            with timing.attach(rates) as t:
                h100._step(dry, model, ids, context)
        plan = context().plan
        assert plan.moved > 0 and context()._planner.measured.duplex < 0.9
        assert t.end <= 1.07 * plain.end, t.end / plain.end
    finally:
        model.to_empty(device="meta")
        dry.module.empty_cache()


def _has_trl() -> bool:
    try:
        import trl.models.activation_offloading  # noqa: F401
    except Exception:
        return False
    return True
