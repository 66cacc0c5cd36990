from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from leakfree import _demo
from leakfree.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


def test_demo_shapes_leak_naive_and_not_with_leakfree() -> None:
    for name, shape in _demo.SHAPES.items():
        naive = shape(__import__("torch").autograd.Function, 5, _demo._device())
        import leakfree

        fixed = shape(leakfree.Function, 5, _demo._device())
        assert naive[-1] > naive[0] > 0, name  # grows every step
        assert fixed[-1] == 0, name


def test_demo_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "naive retained" in out and "3.0 MiB" in out and "0.0 MiB" in out


def test_function_overhead_benchmark_runs(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "function_overhead.py"),
            "--quick",
            "--json",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    data = json.loads(out.read_text())
    assert [r["op"] for r in data["results"]] == ["1-element mul", "1024x1024 matmul"]
    assert all(r["plain_us"] > 0 and r["leakfree_us"] > 0 for r in data["results"])


def test_losslog_benchmark_runs(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "losslog.py"),
            "--quick",
            "--microbatches",
            "256",
            "--json",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    data = json.loads(out.read_text())
    assert data["host_syncs"] == {"per-item .item()": 1024, "LossLog.reduce": 1}
    assert data["retained_bytes"]["plain dict"] == 256 * 4096
    assert data["retained_bytes"]["LossLog"] == 0


def test_offload_benchmark_runs(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "offload.py"),
            "--quick",
            "--steps",
            "3",
            "--json",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    data = json.loads(out.read_text())
    modes = {r["mode"] for r in data["cpu_hook_cost"]}
    assert {"no offloading", "leakfree", "torch save_on_cpu"} <= modes
    assert data["cpu_live_bytes"]["leakfree"] == [0, 0, 0]


def test_pipeline_benchmark_runs(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "pipeline.py"),
            "--quick",
            "--microbatches",
            "10",
            "--json",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    data = json.loads(out.read_text())
    assert data["live_bytes"]["RecvBufferPool"] == [8192] * 10
    assert data["live_bytes"]["leaf receive"][-1] == 10 * 16384


def test_pipeline_example_runs() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "pipeline_two_stages.py"), "--microbatches", "4"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert "gradients bit-identical to one process: True" in done.stdout
