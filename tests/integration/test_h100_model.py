"""The H100 timing model against the H100 run, and the offload targets it predicts.

the H100 run's Llama (542M parameters, bf16, batch 2 x 4096) runs dry on the
simulated device (``tests/simdev/predict.py``): shapes only, every kernel and copy timed
by ``tests/simdev/timing.py``'s H100 model, whose one fitted rate is the FLOP rate of the
step without offloading. Everything else here is a prediction checked against a
measurement, or a target of the plan checked against the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.simdev import predict as h100

pytest.importorskip("transformers")

GiB = 1 << 30


@pytest.fixture(scope="module")
def dry() -> Iterator[Any]:
    if not h100._device.supported():
        pytest.skip("the simulated device needs its supported torch")
    with h100.dry_device() as sim:
        yield sim


def test_the_model_reproduces_the_measured_h100_table_within_15_percent(dry: Any) -> None:
    predicted = h100.calibration(dry)
    none = predicted["none"]
    for mode, p in predicted.items():
        measured = h100.MEASURED[mode]
        ratio = p.step / none.step
        assert ratio == pytest.approx(measured.ratio, rel=0.15), (mode, ratio, measured)
        # what each mode keeps on the device, and moves, as the H100 did
        peak = p.activation_peak / GiB
        assert peak == pytest.approx(measured.activation_gib, rel=0.05), (mode, peak)
        if measured.to_host_gib is not None and mode != "use_streams=False":
            assert p.to_host / GiB == pytest.approx(measured.to_host_gib, rel=0.05), mode


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
    dry: Any, frontier: dict[str, h100.Prediction]
) -> None:
    # the copies back no longer queue behind the copies out, and the compute stream no
    # longer waits for the copies out at the end of the forward
    assert _lower(frontier, "default") >= 0.52
    with h100.as_measured():
        before = h100.predict(dry, "default")
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
