"""The GPU suite cannot rot: its tiny sizes run here, on the simulated device, with the
real transformers and TRL."""

from __future__ import annotations

import sys
from typing import Any


def test_gpu_suite_smoke(sim: Any, tmp_path: Any) -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_suite.py"
    spec = importlib.util.spec_from_file_location("gpu_suite", path)
    assert spec is not None and spec.loader is not None
    suite = importlib.util.module_from_spec(spec)
    sys.modules["gpu_suite"] = suite  # its dataclasses look their module up
    spec.loader.exec_module(suite)
    out = suite.main(["--tiny", "--device", "sim", "--json", str(tmp_path / "gpu.json")])
    assert (tmp_path / "gpu.json").exists()
    modes = out["modes"]
    assert set(modes) == set(suite.MODES) >= {"none", "save_on_cpu", "trl", "leakfree"}
    for name in suite.MODES:
        assert modes[name]["error"] is None, (name, modes[name]["error"])
        assert modes[name]["grads_bit_identical"] is True, name
        after = modes[name]["allocated_after_each_step"]
        assert len(after) == out["size"]["steps"] and len(set(after)) == 1  # flat
    assert modes["leakfree"]["activation_peak_bytes"] < 0.6 * modes["none"]["activation_peak_bytes"]
    assert out["losslog"]["reduce_syncs"] == 1
    assert out["snapshot"] == {"skipped": "a memory snapshot needs CUDA"}
