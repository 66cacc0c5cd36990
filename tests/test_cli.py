from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from leakfree.cli import demo as _demo
from leakfree.cli import main
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
    assert "trl.offload_activations" in out and "known failure mode" in out
    assert "accelerator:" in out


TRL_ROWS = {
    # no accelerator: TRL's constructor raises on every 1.x; the default patch replaces it
    False: (
        {"crash without an accelerator"},
        "patch_all()",
        ("would apply", "raises AttributeError without an accelerator"),
    ),
    # an accelerator, TRL >= 1.5: what remains is repaired by "always" alone
    True: (
        {
            "forward without backward kept",
            "two with blocks, one backward",
            "retain_graph twice",
            "head hooks stack",
        },
        "patch_all(trl='always')",
        ("skipped", "already fixed upstream", "clears its stashes"),
    ),
}


@pytest.mark.parametrize("has_accelerator", [False, True], ids=["cpu-only", "accelerator"])
def test_doctor_names_each_trl_failure_mode_and_the_call_that_repairs_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], has_accelerator: bool
) -> None:
    from packaging.version import Version

    from leakfree.patches import trl as trl_patches
    from leakfree.patches._registry import installed_version

    version = installed_version(("trl",))
    if version is None or not Version("1.5") <= version < Version("2"):
        pytest.skip(f"the rows below are TRL 1.5 - 1.x's; installed: {version}")
    # leakfree's device seam, as the TRL decision sees it (the machine is not changed)
    device = torch.device("cuda") if has_accelerator else None
    monkeypatch.setattr(trl_patches, "accelerator", lambda: device)
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    modes, fix, plan_words = TRL_ROWS[has_accelerator]
    failures = [x.rstrip() for x in lines if x.startswith(f"trl {version}")]
    if version >= Version("1.16"):  # the stream race was fixed in 1.16
        assert {m for m in modes if any(m in x for x in failures)} == modes, failures
        assert len(failures) == len(modes), failures
    assert failures and all(x.endswith(fix) for x in failures), failures
    planned = next(x for x in lines if x.startswith("trl.offload_activations"))
    assert all(word in planned for word in plan_words), planned


@pytest.mark.parametrize(
    ("has_accelerator", "device_type", "expected"),
    [
        (False, None, {"crash without CUDA", "forward without backward kept", "head hooks stack"}),
        (True, "cuda", {"event stash grows", "forward without backward kept", "head hooks stack"}),
        (
            True,
            "mps",
            {"crash without CUDA", "event stash grows", "forward without backward kept"}
            | {"head hooks stack"},
        ),
    ],
)
def test_torchtune_failure_modes_follow_the_machine_and_the_default_patch_repairs_them(
    has_accelerator: bool, device_type: str | None, expected: set[str]
) -> None:
    from packaging.version import Version

    from leakfree.patches import torchtune as torchtune_patches

    rows = torchtune_patches.failure_modes(
        Version("0.6.1"), has_accelerator=has_accelerator, device_type=device_type
    )
    assert {m.name for m, _ in rows} == expected
    assert {fix for _, fix in rows} == {"patch_all()"}
    # 0.3.1 had no get_act_offloading_ctx_manager: no hook rows there
    old = torchtune_patches.failure_modes(Version("0.3.1"), has_accelerator=False)
    assert "head hooks stack" not in {m.name for m, _ in old}


def test_doctor_points_at_scan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    assert "python -m leakfree scan PATH_OR_PACKAGE" in capsys.readouterr().out


def test_doctor_lists_the_installed_torchtune(capsys: pytest.CaptureFixture[str]) -> None:
    from leakfree.patches._registry import installed_version

    version = installed_version(("torchtune",))
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"torchtune: {version if version is not None else 'not installed'}" in out
    if version is not None:
        assert f"torchtune {version}" in out  # its failure-mode rows


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


# --- an instant, honest CLI --------------------------------------------------------------------

_AS_SCRIPT = """
import sys
sys.argv[0] = {argv0!r}
from leakfree.cli import main
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
    ("args", "code"),
    [
        (["--help"], 0),
        (["--version"], 0),
        (["frobnicate"], 2),
        ([], 2),
        (["run", "--help"], 0),
        (["run"], 2),
        (["run", "--sample-every", "x", "train.py"], 2),
    ],
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


def test_run_usage_names_its_options_and_exit_codes() -> None:
    out, _ = _cli("run", "--help")
    assert out.startswith("usage: leakfree run [options] (SCRIPT | -m MODULE) [ARGS...]")
    assert "--fail" in out and "79" in out and "--sample-every K" in out
    assert "78 if none was but the run ended before it could be judged" in " ".join(out.split())
    _, err = _cli("run", "-m")
    assert "leakfree run: error: argument -m: expected one argument" in err


def test_snapshot_with_three_files_prints_snapshots_usage() -> None:
    _, err = _cli("snapshot", "a", "b", "c")
    assert err.startswith("usage: leakfree snapshot ")
    assert "snapshot takes one file, or two to diff" in err


def test_doctor_points_to_docs_that_exist(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    from leakfree.cli import doctor as _doctor

    assert main(["doctor"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("known leaks"))
    assert str(ROOT / "docs" / "patches.md") in line and (ROOT / "docs" / "patches.md").is_file()
    # an installed package has no docs/ next to it: point at what every install has
    monkeypatch.setattr(_doctor.leakfree, "__file__", "/site-packages/leakfree/__init__.py")
    assert main(["doctor"]) == 0
    assert "python -m pydoc leakfree.patches" in capsys.readouterr().out


def test_readme_install_section_names_no_index_package() -> None:
    """`pip install leakfree` fails: the package is on no index. Install says what works."""
    readme = (ROOT / "README.md").read_text()
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert "pip install leakfree" not in install.replace("pip install leakfree-", "")
    assert "pip install ." in install and "pip wheel" in install


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


def test_snapshot_names_an_unknown_option() -> None:
    _, err = _cli("snapshot", "--bogus")
    assert "unknown option --bogus" in err and "required" not in err
