"""The scripts end to end, in subprocesses: the console script, every benchmark at its
smoke size, the pipeline example, the demo's redirected output, the sdist and wheel. The
benchmarks, the example and the demo run forked from a process that has imported torch
only (``tests._fresh.run_python``); the rest in new interpreters."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from leakfree.cli import demo as _demo
from tests._fresh import run_python

ROOT = Path(__file__).resolve().parents[2]


def test_console_script_entry_point() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "leakfree", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "doctor" in done.stdout and "snapshot" in done.stdout
    script = shutil.which("leakfree")  # the console script, where leakfree is installed
    if script is not None:
        done = subprocess.run([script, "doctor"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "known leaks" in done.stdout


def run_benchmark(name: str, tmp_path: Path, *args: str) -> Any:
    """``python benchmarks/NAME.py --quick ARGS``, forked from the torch-preloaded server."""
    out = tmp_path / f"{name}.json"
    script = str(ROOT / "benchmarks" / f"{name}.py")
    argv = (script, "--quick", *args, "--json", str(out))
    status, _, stderr = run_python(*argv, cwd=tmp_path, timeout=300)
    assert status == 0, stderr[-3000:]
    return json.loads(out.read_text())


def test_import_leakfree_is_lazy_and_complete() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, leakfree; assert 'torch' not in sys.modules; "
            "[getattr(leakfree, n) for n in leakfree.__all__]; print(sorted(dir(leakfree))[:1])",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_function_overhead_benchmark_runs(tmp_path: Path) -> None:
    data = run_benchmark("function_overhead", tmp_path)
    ops = [r["op"] for r in data["results"]]
    assert ops == [
        "1-element mul",
        "1-element mul, tensor on ctx",
        "1-element mul, forward only",
        "1024x1024 matmul",
    ]
    assert all(
        r["ratio_spread"]["q1"] <= r["ratio"] <= r["ratio_spread"]["q3"] for r in data["results"]
    )
    assert all(r["plain_us"] > 0 and r["leakfree_us"] > 0 for r in data["results"])


def test_losslog_benchmark_runs(tmp_path: Path) -> None:
    data = run_benchmark("losslog", tmp_path, "--microbatches", "256")
    assert data["host_syncs"] == {"per-item .item()": 1024, "LossLog.reduce": 1}
    assert data["retained_bytes"]["plain dict"] == 256 * 4096
    assert data["retained_bytes"]["LossLog"] == 0


def test_offload_benchmark_runs(tmp_path: Path) -> None:
    data = run_benchmark("offload", tmp_path, "--steps", "3")
    rows = {(r["width"], r["mode"]) for r in data["cpu_hook_cost"]}
    modes = ("no offloading", "torch save_on_cpu", "leakfree, reused", "leakfree, new each step")
    assert rows == {(w, m) for w in (64, 512) for m in modes}
    assert data["cpu_live_bytes"]["leakfree"] == [0, 0, 0]
    if isinstance(data["sim"], str):  # not run, and why (a real accelerator, an old torch)
        return
    titles = [m["title"] for m in data["sim"]["models"]]
    assert len(titles) == 2 and "width 64" in titles[0] and "Llama" in titles[1]
    for model in data["sim"]["models"]:
        modes = model["modes"]
        for name in ("none", "save_on_cpu", "leakfree"):
            assert modes[name]["available"], (name, modes[name])
        for name, m in modes.items():
            assert not m["available"] or m["grads_bit_identical"], name
        assert modes["leakfree"]["flat"] and modes["leakfree"]["copies_per_step"]["to_host"] > 0
        keep_all = modes["leakfree keep-all"]
        assert not keep_all["available"] or keep_all["copies_per_step"]["to_host"] == 0


def test_pipeline_benchmark_runs(tmp_path: Path) -> None:
    data = run_benchmark("pipeline", tmp_path, "--microbatches", "10")
    assert data["live_bytes"]["RecvBufferPool"] == [8192] * 10
    assert data["live_bytes"]["leaf receive"][-1] == 10 * 16384


def test_pipeline_example_runs(tmp_path: Path) -> None:
    example = str(ROOT / "examples" / "pipeline_two_stages.py")
    status, stdout, stderr = run_python(example, "--microbatches", "4", cwd=tmp_path, timeout=180)
    assert status == 0, stderr
    assert "gradients bit-identical to one process: True" in stdout


def test_sdist_and_wheel_ship_the_licence_and_no_partial_test_tree(tmp_path: Path) -> None:
    import tarfile
    import zipfile

    done = subprocess.run(
        [
            sys.executable,
            "-c",
            # build_meta rewrites sys.argv: read the output directory first
            "import sys; out = sys.argv[1]; from setuptools import build_meta as b; "
            "s = b.build_sdist(out); w = b.build_wheel(out); print('BUILT', s, w)",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    built = next(line for line in done.stdout.splitlines() if line.startswith("BUILT "))
    sdist_name, wheel_name = built.split()[1:]
    with tarfile.open(tmp_path / sdist_name) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
    assert "LICENSE" in names
    assert not [n for n in names if n.startswith("tests/")], "ship the whole test tree or none"
    # every doc README links to ships with it
    linked = set(re.findall(r"\]\((docs/[^)#]+)", (ROOT / "README.md").read_text()))
    assert linked and linked <= set(names), sorted(linked - set(names))
    with zipfile.ZipFile(tmp_path / wheel_name) as whl:
        files = whl.namelist()
        metadata = whl.read(next(f for f in files if f.endswith(".dist-info/METADATA"))).decode()
    assert any(f.endswith("LICENSE") for f in files)
    assert "leakfree/cli/_child/sitecustomize.py" in files  # `leakfree run` watches children
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert any(r.split()[1].startswith("numpy") for r in requires), requires
    # PEP 639: an SPDX expression, not the TOML table that stops working in 2027
    assert "License-Expression: Apache-2.0" in metadata, metadata[:800]


def test_demo_out_no_progress_bar_when_redirected_and_says_what_stays(tmp_path: Path) -> None:
    png = tmp_path / "plots" / "demo.png"
    png.parent.mkdir()
    argv = ("-m", "leakfree", "demo", "--steps", "4", "--out", str(png))
    status, stdout, stderr = run_python(*argv, cwd=tmp_path, timeout=300)
    assert status == 0, stderr
    assert "\r" not in stderr and "\r" not in stdout  # no bar in a redirected log
    assert png.is_file() if "plot: skipped" not in stdout else True
    assert not (tmp_path / "leakfree-demo.png").exists()
    for name in _demo.KEPT_ON_PURPOSE:
        assert f"  {name}: " in stdout
    assert "offloader's host blocks" in stdout


def test_tracker_hf_benchmark_runs(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    data = run_benchmark("tracker_hf", tmp_path)
    every = {r["options"].get("sample_every", 8) for r in data["results"]}
    assert every == {1, 8}  # exact and the default, against the same untracked run
    assert all(r["off_ms_per_step"] > 0 and r["ratio"]["median"] > 0 for r in data["results"])
    assert all(r["findings"] == [] for r in data["results"])  # a clean loop: no finding
