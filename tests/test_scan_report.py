"""What a user reads: the text report grouped by Function, GitHub annotations, and a
baseline that leaves out the findings a team has already seen."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from leakfree.__main__ import main
from leakfree.scan import render, scan
from leakfree.scan._locate import UsageError

# mmcv 2.2.0 ops/gather_points.py and three_interpolate.py (labelled stacks): index tensors
# kept in a tuple on ctx; one Function also parks a size and an empty workspace
OPS = """
import torch
from torch.autograd import Function


class GatherPoints(Function):
    @staticmethod
    def forward(ctx, features: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        assert indices.is_contiguous()
        B, npoint = indices.size()
        _, C, N = features.size()
        output = features.new_zeros((B, C, npoint))
        ext_module.gather_points_forward(features, indices, output, b=B, c=C, n=N)
        ctx.for_backwards = (indices, C, N)
        ctx.bufs = [features.new_empty(0)]
        return output

    @staticmethod
    def backward(ctx, grad_out):
        idx, C, N = ctx.for_backwards
        grad = grad_out.new_zeros((idx.size(0), C, N))
        ext_module.gather_points_backward(grad_out, idx, grad, ctx.bufs[0])
        return grad, None


class ThreeInterpolate(Function):
    @staticmethod
    def forward(ctx, features: torch.Tensor, indices: torch.Tensor, weight: torch.Tensor):
        B, c, m = features.size()
        ctx.three_interpolate_for_backward = (indices, weight, m)
        output = features.new_empty(B, c, indices.size(1))
        ext_module.three_interpolate_forward(features, indices, weight, output)
        return output

    @staticmethod
    def backward(ctx, grad_out):
        idx, weight, m = ctx.three_interpolate_for_backward
        grad = grad_out.new_zeros(grad_out.size(0), grad_out.size(1), m)
        ext_module.three_interpolate_backward(grad_out, idx, weight, grad)
        return grad, None, None
"""


def _write(tmp_path: Path, text: str = OPS) -> Path:
    path = tmp_path / "ops.py"
    path.write_text(textwrap.dedent(text))
    return path


def test_text_groups_findings_per_function_with_one_line_of_evidence_and_counts(
    tmp_path: Path,
) -> None:
    path = _write(tmp_path)
    lines = render(scan([str(path)]), "text").splitlines()
    assert lines[0] == path.as_posix()
    assert lines[1] == "  GatherPoints"
    assert lines[2].startswith("    14:9 LF001 for_backwards: ctx.for_backwards holds tensors")
    assert lines[3].startswith("    15:9 LF001 (note) bufs: ctx.bufs holds a tensor of a few")
    assert lines[4] == "  ThreeInterpolate"
    assert lines[5].startswith("    30:9 LF001 three_interpolate_for_backward: ")
    # one line of evidence, not the advice: that comes once per rule, with the counts
    assert all("set the attribute to None" not in line for line in lines[:6])
    assert "LF001 ctx-outlives-backward: 2 warnings, 1 note" in lines
    assert any(line.startswith("  fix: set the attribute to None") for line in lines)
    assert lines[-1].startswith("2 findings and 1 note in 1 file")


def test_github_format_annotates_each_finding_escaped(tmp_path: Path) -> None:
    path = _write(tmp_path).as_posix()  # as the scan shows it (relative when run from a root)
    (tmp_path / "bad.py").write_text("def f(:\n")
    out = render(scan([str(tmp_path)]), "github").splitlines()
    warning = [line for line in out if line.startswith("::warning ")]
    assert len(warning) == 2
    assert warning[0].startswith(
        f"::warning file={path},line=14,col=9,title=LF001 GatherPoints.for_backwards::"
    )
    assert any(line.startswith(f"::notice file={path},line=15,") for line in out)
    assert any(line.startswith("::error file=") and "title=not parsed::" in line for line in out)
    assert "\n" not in warning[0] and "%0A" not in warning[0]


def test_a_baseline_leaves_out_what_it_lists_even_after_lines_move(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path)
    baseline = tmp_path / "baseline.json"
    assert main(["scan", str(path), "--format", "json", "-o", str(baseline)]) == 1
    capsys.readouterr()
    # the code moves down and a third Function keeps its input: only that one is new
    _write(tmp_path, "# a header\n\n" + OPS + OPS_NEW)
    rc = main(["scan", str(path), "--baseline", str(baseline), "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1 and [f["symbol"] for f in report["findings"]] == ["Keep.x"]
    assert report["baselined"] == 3
    # with nothing new, the scan passes
    _write(tmp_path, "# a header\n\n" + OPS)
    assert main(["scan", str(path), "--baseline", str(baseline)]) == 0
    assert "3 more listed in the baseline, left out" in capsys.readouterr().out


OPS_NEW = """

class Keep(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.x = x
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2
"""


def test_a_baseline_that_is_no_report_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path)
    with pytest.raises(UsageError, match=r"scan\(baseline='.*missing.json'\): no such file"):
        scan([str(path)], baseline=tmp_path / "missing.json")
    (tmp_path / "other.json").write_text('{"runs": []}')
    with pytest.raises(UsageError, match="no list of findings with rule, path and symbol"):
        scan([str(path)], baseline=str(tmp_path / "other.json"))
    with pytest.raises(SystemExit) as exit_:
        main(["scan", str(path), "--baseline", str(tmp_path / "missing.json")])
    assert exit_.value.code == 2 and "no such file" in capsys.readouterr().err
