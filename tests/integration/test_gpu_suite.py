"""The GPU suite cannot rot: its dry run (every part on the simulated H100, with the real
transformers and TRL) runs here as a GPU run would, in a subprocess with a bounded wait,
and leaves every part in its JSON; out of time, a part stops, keeps what it has and says
so."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "benchmarks" / "gpu_suite.py"
PARTS = ["link", "frontier", "gradients", "shapes", "fit"]


def dry_run(tmp_path: Path, *args: str, wait: float = 55) -> dict[str, Any]:
    """``gpu_suite.py --dry ARGS``, its JSON (the run must end within ``wait`` seconds)."""
    pytest.importorskip("transformers")
    from tests import simdev

    if not simdev.supported():
        pytest.skip("the simulated device does not support this torch")
    out = tmp_path / "suite.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(SUITE), "--dry", "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=wait,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return dict(json.loads(out.read_text()))


def test_dry_run_leaves_every_part_in_the_json(tmp_path: Path) -> None:
    data = dry_run(tmp_path, "--small")
    assert data["dry"] is True and data["running"] is None
    assert data["parts_done"] == PARTS and set(data["parts"]) == set(PARTS)
    for name, part in data["parts"].items():
        assert part.get("error") is None, (name, part.get("error"))
        assert part["timed_out"] is None, (name, part["timed_out"])
        assert "partial" not in part and part["seconds"] <= part["budget_s"]
    link = data["parts"]["link"]
    for way in ("to_host", "to_device"):  # the H100 model's link: full duplex, 55 GB/s
        assert 50 < link[f"{way}_alone"] < 60 and link["both_at_once"][way] > 50
    modes = data["parts"]["frontier"]["modes"]
    assert list(modes) == ["none", "default", "max_overhead", "device_limit", "trl", "save_on_cpu"]
    for name, row in modes.items():
        assert row["error"] is None, (name, row["error"])
        assert row["ratio_vs_none"]["median"] >= 0.99 and row["held_peak_bytes"] > 0
        after = row["allocated_after_each_step"]
        assert max(after) == after[0]  # nothing kept from step to step (TRL's frees late)
    assert modes["default"]["held_peak_bytes"] < modes["none"]["held_peak_bytes"]
    for goal in ("max_overhead", "device_limit"):  # the plan's predictions beside measured
        predicted, measured = modes[goal]["plan_vs_measured"]["held"]
        assert predicted > 0 and measured > 0
    gradients = data["parts"]["gradients"]["modes"]
    assert {m: r["bit_identical"] for m, r in gradients.items()} == {
        "default": True,
        "max_overhead": True,
        "device_limit": True,
    }
    shapes = data["parts"]["shapes"]["modes"]
    assert shapes["device_limit"]["under_limit_every_step"] is True
    assert all(len(shapes[m]["steps"]) == 9 for m in shapes)
    fit = data["parts"]["fit"]
    assert fit["cap_bytes"] > fit["parameter_bytes"] > 0
    longest = {m: r["longest_seq"] for m, r in fit["modes"].items()}
    assert set(longest) == {"none", "default", "device_limit=cap", "checkpoint"}
    assert longest["none"] == 4096  # the cap is what none needs at 4096
    assert longest["device_limit=cap"] > longest["none"]
    assert all(t["hooks_left_pushed"] == 0 for r in fit["modes"].values() for t in r["tries"])
    verdicts = {c["verdict"] for c in data["checks"]}
    assert "FAIL" not in verdicts and "pass" in verdicts


def test_a_part_out_of_time_keeps_what_it_has(tmp_path: Path) -> None:
    data = dry_run(
        tmp_path,
        "--small",
        "--parts",
        "frontier,fit",
        "--budget",
        "frontier=0",
        "--budget",
        "fit=0",
    )
    assert data["parts_done"] == ["frontier", "fit"] and data["running"] is None
    frontier, fit = data["parts"]["frontier"], data["parts"]["fit"]
    assert frontier["timed_out"] == "stopped after 0 of 3 rounds"
    assert frontier["modes"]["none"]["error"] == "no measured step"
    assert fit["timed_out"] == "stopped during none" and fit["modes"]["none"]["incomplete"]
    assert fit["cap_bytes"] > 0  # measured before the search began
    assert all(c["verdict"] != "FAIL" for c in data["checks"])


def test_a_steps_peaks_are_the_steps_and_the_library_leaves_them_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The suite's reading of a step's peaks is the step's (the H100 model's timeline sees
    every count), and leakfree's goals no longer reset the peak counters inside a step:
    the counters at the step's end hold its peak (earlier versions reset them after it)."""
    pytest.importorskip("transformers")
    from tests import simdev
    from tests.simdev import timing

    if not simdev.supported():
        pytest.skip("the simulated device does not support this torch")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _suite_device import SMALL, Bench, context

    timelines: list[Any] = []

    class Recording(timing.attach):
        def __enter__(self) -> Any:
            timelines.append(super().__enter__())
            return timelines[-1]

    monkeypatch.setattr(timing, "attach", Recording)
    with simdev.enabled() as sim:
        sim.dry = True
        bench = Bench(sim.device, SMALL.with_(seq=1024), sim=sim)
        model, ids = bench.model(), bench.ids(1024)
        for name, p in model.named_parameters():  # the peak early in backward, not at its
            p.requires_grad_(name.startswith("lm_head"))  # end (no gradients pile up)
        none = bench.step(model, ids, contextlib.nullcontext)
        make = context("device_limit", model, bench, limit=none.before + none.held * 9 // 10)
        missed = []
        for _ in range(3):  # measured, checked, followed
            step = bench.step(model, ids, make)
            seen = timelines[-1]
            assert (step.allocated_total, step.held_total) == (seen.peak, seen.held_peak)
            missed.append(int(sim.module.max_memory_allocated()) < seen.peak)
        assert not any(missed)  # measured, checked or followed: no step reset them
        bench.drop(model)
