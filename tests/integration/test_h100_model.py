"""The H100 timing model against the H100 run, and the offload targets it predicts.

the H100 run's Llama (bf16, hidden 2048, 8 layers; each table with its own intermediate
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
def frontier(dry: Any) -> dict[str, h100.Prediction]:
    return h100.frontier(dry, trl=_has_trl())


def _has_trl() -> bool:
    try:
        import trl.models.activation_offloading  # noqa: F401
    except Exception:
        return False
    return True


def _ratio(frontier: dict[str, h100.Prediction], mode: str) -> float:
    return frontier[mode].step / frontier["none"].step


def _lower(frontier: dict[str, h100.Prediction], mode: str) -> float:
    return 1 - frontier[mode].activation_peak / frontier["none"].activation_peak


def test_a_five_percent_time_cap_saves_at_least_15_percent_within_7_percent(
    frontier: dict[str, h100.Prediction],
) -> None:
    mode = "max_overhead=0.05"
    assert _ratio(frontier, mode) <= 1.07
    assert _lower(frontier, mode) >= 0.15
    plan = frontier[mode].plan
    assert plan.mode.value == "max_overhead" and 0 < plan.moved_bytes == frontier[mode].to_host
    assert plan.overhead <= 0.05


def test_a_ceiling_1_gib_under_the_peak_is_held_within_15_percent(
    frontier: dict[str, h100.Prediction],
) -> None:
    mode = "device_limit=peak-1GiB"
    p = frontier[mode]
    assert _ratio(frontier, mode) <= 1.15
    assert p.activation_peak <= frontier["none"].activation_peak - GiB
    assert p.plan.mode.value == "device_limit"
    # the plan's own prediction of its peak is the model's, within 2%
    assert p.plan.peak == pytest.approx(p.allocated_before + p.activation_peak, rel=0.02)


def test_the_default_moves_what_it_did_faster_than_measured(
    calibrated: dict[tuple[str, str], h100.Prediction], frontier: dict[str, h100.Prediction]
) -> None:
    # the copies back no longer queue behind the copies out, and the compute stream no
    # longer waits for the copies out at the end of the forward
    assert _lower(frontier, "default") >= 0.52
    before = calibrated["second", "default"]  # the same model, with the schedule measured
    assert frontier["default"].to_host == before.to_host
    assert frontier["default"].step < 0.95 * before.step


def test_every_goal_is_ahead_of_trl_on_time_and_peak(frontier: dict[str, h100.Prediction]) -> None:
    if "trl" not in frontier:
        pytest.skip("TRL is not installed")
    trl = frontier["trl"]
    at_trl = frontier["device_limit=TRL's peak"]
    assert at_trl.activation_peak <= trl.activation_peak and at_trl.step < trl.step
    for mode in ("default", "device_limit=default's peak"):  # lower and faster
        assert frontier[mode].activation_peak < trl.activation_peak
        assert frontier[mode].step < trl.step
    for mode in ("max_overhead=0.05", "max_overhead=0.25", "device_limit=peak-1GiB"):
        assert frontier[mode].step < trl.step  # faster, keeping more on the device
