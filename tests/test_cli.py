from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from leakfree import _demo
from leakfree.__main__ import main
from leakfree.diagnostics import fit_growth

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("shape", _demo.SHAPES, ids=[s[0] for s in _demo.SHAPES])
def test_demo_shape_leaks_naive_and_not_with_leakfree(shape: Any) -> None:
    name, _where, make = shape
    device = torch.device("cpu")
    naive = fit_growth(_demo.measure(make, False, 8, device)[1:])
    fixed = fit_growth(_demo.measure(make, True, 8, device)[1:])
    assert naive.exceeds(4096), name  # at least 4 KiB per step without leakfree
    assert not fixed.exceeds(1024), name  # with it, at most what the loop itself keeps


def test_demo_command(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "demo.png"
    assert main(["demo", "--steps", "5", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for name, _, _ in _demo.SHAPES:
        assert name in out
    assert "naive / step" in out and f"plot: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_doctor_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out
    assert "transformer_engine: not installed" in out
    assert "trl.offload_activations" in out and "not affected" in out
    assert "accelerator:" in out


def test_snapshot_command(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    block = {
        "size": 2 << 20,
        "requested_size": 2 << 20,
        "address": 4096,
        "state": "active_allocated",
        "frames": [{"filename": "train.py", "line": 7, "name": "step"}],
    }
    segment = {
        "device": 0,
        "address": 4096,
        "total_size": 2 << 20,
        "allocated_size": 2 << 20,
        "active_size": 2 << 20,
        "requested_size": 2 << 20,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": [block],
    }
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"segments": [segment], "device_traces": [[]]}))
    assert main(["snapshot", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2.0" in out and "train.py:7:step" in out
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(pickle.dumps([1, 2]))
    assert main(["snapshot", str(bad)]) == 2


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
    out = tmp_path / f"{name}.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / f"{name}.py"),
            "--quick",
            *args,
            "--json",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return json.loads(out.read_text())


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


def test_pipeline_benchmark_runs(tmp_path: Path) -> None:
    data = run_benchmark("pipeline", tmp_path, "--microbatches", "10")
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


# --- [2/6]: an instant, honest CLI -------------------------------------------------------------

_AS_SCRIPT = """
import sys
sys.argv[0] = {argv0!r}
from leakfree.__main__ import main
try:
    code = main({args!r})
except SystemExit as e:
    code = e.code
print("TORCH_IMPORTED", "torch" in sys.modules, "EXIT", code)
"""


def _cli(*args: str, argv0: str = "/usr/local/bin/leakfree") -> tuple[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", _AS_SCRIPT.format(argv0=argv0, args=list(args))],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    return done.stdout, done.stderr


@pytest.mark.parametrize(
    ("args", "code"), [(["--help"], 0), (["--version"], 0), (["frobnicate"], 2), ([], 2)]
)
def test_help_version_and_usage_errors_do_not_import_torch(args: list[str], code: int) -> None:
    out, err = _cli(*args)
    assert f"TORCH_IMPORTED False EXIT {code}" in out, (out, err)


def test_version_and_usage_name_the_command() -> None:
    out, _ = _cli("--version")
    assert out.startswith("leakfree 0.")
    out, _ = _cli("--help")
    assert out.startswith("usage: leakfree ")
    out, _ = _cli("--help", argv0="/x/leakfree/__main__.py")
    assert out.startswith("usage: python -m leakfree ")


def test_snapshot_with_three_files_prints_snapshots_usage() -> None:
    _, err = _cli("snapshot", "a", "b", "c")
    assert err.startswith("usage: leakfree snapshot ")
    assert "snapshot takes one file, or two to diff" in err


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


def test_doctor_points_to_docs_that_exist(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    from leakfree import _doctor

    assert main(["doctor"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("known leaks"))
    assert str(ROOT / "docs" / "patches.md") in line and (ROOT / "docs" / "patches.md").is_file()
    # an installed package has no docs/ next to it: point at what every install has
    monkeypatch.setattr(_doctor.leakfree, "__file__", "/site-packages/leakfree/__init__.py")
    assert main(["doctor"]) == 0
    assert "python -m pydoc leakfree.patches" in capsys.readouterr().out


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
    with zipfile.ZipFile(tmp_path / wheel_name) as whl:
        files = whl.namelist()
        metadata = whl.read(next(f for f in files if f.endswith(".dist-info/METADATA"))).decode()
    assert any(f.endswith("LICENSE") for f in files)
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert any(r.split()[1].startswith("numpy") for r in requires), requires


def test_readme_install_section_names_no_index_package() -> None:
    """`pip install leakfree` fails: the package is on no index. Install says what works."""
    readme = (ROOT / "README.md").read_text()
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert "pip install leakfree" not in install.replace("pip install leakfree-", "")
    assert "pip install ." in install and "pip wheel" in install


def test_demo_out_no_progress_bar_when_redirected_and_says_what_stays(tmp_path: Path) -> None:
    png = tmp_path / "plots" / "demo.png"
    png.parent.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "leakfree", "demo", "--steps", "4", "--out", str(png)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr and "\r" not in done.stdout  # no bar in a redirected log
    assert png.is_file() if "plot: skipped" not in done.stdout else True
    assert not (tmp_path / "leakfree-demo.png").exists()
    for name in _demo.KEPT_ON_PURPOSE:
        assert f"  {name}: " in done.stdout
    assert "offloader's host blocks" in done.stdout


def test_default_demo_plot_is_ignored_by_git() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "check-ignore", "-q", "leakfree-demo.png"], cwd=ROOT, timeout=30)
    assert done.returncode == 0


def test_snapshot_analysis_does_not_import_torch(tmp_path: Path) -> None:
    from tests.test_snapshot import make_snapshot, write

    path = write(tmp_path / "snap.pickle", make_snapshot())
    out, err = _cli("snapshot", str(path))
    assert "TORCH_IMPORTED False EXIT 0" in out, (out, err)
    assert "Dead-stream suspects" in out
