"""The GPU suite cannot rot: its tiny sizes run here, on the simulated device, with the
real transformers and TRL."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest


def test_gpu_suite_smoke(sim: Any, tmp_path: Any) -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_suite.py"
    spec = importlib.util.spec_from_file_location("gpu_suite", path)
    assert spec is not None and spec.loader is not None
    suite = importlib.util.module_from_spec(spec)
    sys.modules["gpu_suite"] = suite  # its dataclasses look their module up
    spec.loader.exec_module(suite)
    # Into a folder that does not exist yet, with the last part failing (as the snapshot
    # did on a real H100): every part before it is in the JSON.
    snapshots: list[Any] = []

    def failing_snapshot(*args: Any) -> Any:
        snapshots.append(real_snapshot(*args))
        raise RuntimeError("the snapshot failed")

    real_snapshot, suite.snapshot = suite.snapshot, failing_snapshot
    written = tmp_path / "not" / "made" / "yet" / "gpu.json"
    with pytest.raises(RuntimeError, match="the snapshot failed"):
        suite.main(["--tiny", "--device", "sim", "--json", str(written)])
    out = json.loads(written.read_text())
    assert out["parts_done"] == [
        "setup", "gradients", "modes", "overlap", "sanitizer", "losslog"
    ]  # fmt: skip
    modes = out["modes"]
    assert set(modes) == set(suite.MODES) >= {"none", "save_on_cpu", "trl", "leakfree"}
    for name in suite.MODES:
        assert modes[name]["error"] is None, (name, modes[name]["error"])
        assert modes[name]["grads_bit_identical"] is True, name
        after = modes[name]["allocated_after_each_step"]
        assert len(after) == out["size"]["steps"] and len(set(after)) == 1  # flat
    none_peak = modes["none"]["activation_peak_bytes"]
    assert modes["leakfree"]["activation_peak_bytes"] < 0.6 * none_peak
    # the goals plan from a measured step and follow their plans after it
    assert "max_overhead" in modes["leakfree max_overhead"]["plan"]
    limited = modes["leakfree device_limit"]
    assert limited["device_limit"] is not None and limited["peak_bytes"] <= limited["device_limit"]
    assert out["copy_overlap"]["leakfree"] == {"skipped": "the profiler's copy timeline needs CUDA"}
    assert out["sanitizer"] == {"skipped": "the CUDA Sanitizer needs CUDA"}
    assert out["losslog"]["reduce_syncs"] == 1
    assert snapshots == [{"skipped": "a memory snapshot needs CUDA"}]
