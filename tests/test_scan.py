"""The scanner's machinery: finding files and packages without importing them, suppression
comments, rule selection, output formats, exit codes. The rules themselves:
tests/test_scan_*.py."""

from __future__ import annotations

import ast
import json
import sys
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from leakfree.__main__ import main
from leakfree.scan import Finding, Project, Rule, ScanResult, Source, UsageError, render, scan
from leakfree.scan._run import choose_rules, suppressions


def _flag_parked(source: Source, project: Project) -> Iterator[Finding]:
    """A rule for the machinery's tests: every ``<name>.parked = ...`` assignment."""
    for node in ast.walk(source.tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr == "parked":
                    yield source.finding(target, "LF900", "x.parked", "parked on x")


def _flag_helper_calls(source: Source, project: Project) -> Iterator[Finding]:
    """Flags a call whose helper, defined in any scanned file, assigns ``.parked``."""
    for node in ast.walk(source.tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            for where, helper in project.helpers(node.func.id):
                nodes = ast.walk(helper)
                if any(isinstance(n, ast.Attribute) and n.attr == "parked" for n in nodes):
                    yield source.finding(node, "LF901", node.func.id, f"parks ({where.path})")


PARKED = Rule("LF900", "parked", "x.parked =", "find_retained", _flag_parked, needs=(".parked",))
HELPED = Rule(
    "LF901",
    "helped",
    "calls a parking helper",
    "assert_no_leak",
    _flag_helper_calls,
    needs=("restore(",),
)
RULES = (PARKED, HELPED)


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def codes(result: ScanResult) -> list[tuple[str, int, str]]:
    return [(Path(f.path).name, f.line, f.rule) for f in result.findings]


def test_suppression_comments_are_real_comments_per_rule_and_line() -> None:
    text = textwrap.dedent(
        """\
        x.parked = 1  # leakfree: ignore[LF900]
        x.parked = 2  # leakfree: ignore[LF001, lf900]
        x.parked = 3  # leakfree: ignore
        x.parked = 4  # leakfree: ignore[LF001]
        s = "# leakfree: ignore[LF900]"; x.parked = 5
        x.parked = 6
        """
    )
    assert suppressions(text) == {1: {"LF900"}, 2: {"LF001", "LF900"}, 3: {"*"}, 4: {"LF001"}}
    from leakfree.scan import scan_sources

    source = Source("m.py", text, ast.parse(text))
    assert [f.line for f in scan_sources([source], [PARKED])] == [4, 5, 6]


def test_select_and_ignore_take_codes_and_prefixes_and_refuse_unknown_ones() -> None:
    assert choose_rules(RULES) == list(RULES)
    assert choose_rules(RULES, select=["LF900"]) == [PARKED]
    assert choose_rules(RULES, select=["lf9"], ignore=["LF901"]) == [PARKED]
    assert choose_rules(RULES, select=[""], ignore=[""]) == list(RULES)
    with pytest.raises(UsageError, match=r"--select LF7: no such rule \(rules: LF900, LF901\)"):
        choose_rules(RULES, select=["LF7"])
    with pytest.raises(UsageError, match="--ignore XX"):
        choose_rules(RULES, ignore=["XX"])


def test_a_helper_in_another_file_is_followed_and_only_needed_files_are_parsed(
    tmp_path: Path,
) -> None:
    write(
        tmp_path,
        {
            "a.py": "restore(ctx)\n",
            "helpers/b.py": "def restore(ctx):\n    ctx.parked = None\n",
            "c.py": "def unrelated(:\n",  # does not parse, and no rule needs it
        },
    )
    result = scan([str(tmp_path)], rules=RULES, select=["LF901"])
    assert codes(result) == [("a.py", 1, "LF901")]  # b.py's own text is not "restore("
    assert result.findings[0].message.endswith(f"({tmp_path.as_posix()}/helpers/b.py)")
    assert result.files == 3 and result.unparsed == []  # c.py was never parsed


def test_files_a_rule_needs_that_do_not_parse_are_listed_not_raised(tmp_path: Path) -> None:
    write(tmp_path, {"bad.py": "x.parked = (\n", "good.py": "x.parked = 1\n"})
    result = scan([str(tmp_path)], rules=RULES)
    assert codes(result) == [("good.py", 1, "LF900")]
    assert len(result.unparsed) == 1 and "bad.py: SyntaxError" in result.unparsed[0]


def test_folders_skip_caches_and_hidden_dirs_and_honour_exclude(tmp_path: Path) -> None:
    body = "x.parked = 1\n"
    write(
        tmp_path,
        {
            "pkg/m.py": body,
            "pkg/__pycache__/m.py": body,
            "pkg/.venv/lib.py": body,
            "pkg/tests/test_m.py": body,
            "pkg/notes.txt": body,
        },
    )
    assert [f for _, _, f in codes(scan([str(tmp_path)], rules=RULES))] == ["LF900"] * 2
    result = scan([str(tmp_path)], rules=RULES, exclude=["*/tests/*"])
    assert [name for name, _, _ in codes(result)] == ["m.py"]


def test_a_package_is_found_by_import_name_without_being_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(
        tmp_path,
        {
            "needs_cuda/__init__.py": "raise ImportError('needs CUDA')\n",
            "needs_cuda/ops/fuser.py": "x.parked = 1\n",
            "needs_cuda/other.py": "y = 1\n",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    result = scan(["needs_cuda.ops"], rules=RULES)
    assert [f.path for f in result.findings] == ["needs_cuda/ops/fuser.py"]
    result = scan(["needs_cuda"], rules=RULES)
    assert result.files == 3 and "needs_cuda" not in sys.modules
    with pytest.raises(UsageError, match="'needs_cuda.missing': no such file or folder"):
        scan(["needs_cuda.missing"], rules=RULES)


def test_bad_paths_are_usage_errors_before_anything_is_read(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x.parked = 1\n")
    with pytest.raises(UsageError, match="not a Python file"):
        scan([str(tmp_path / "notes.txt")], rules=RULES)
    with pytest.raises(UsageError, match="no installed package of that import name"):
        scan([str(tmp_path / "missing.py")], rules=RULES)


def _result(tmp_path: Path) -> ScanResult:
    write(tmp_path, {"m.py": "x.parked = 1\n"})
    return scan([str(tmp_path / "m.py")], rules=RULES)


def test_text_report_is_one_line_per_finding_then_how_to_confirm_and_suppress(
    tmp_path: Path,
) -> None:
    lines = render(_result(tmp_path), "text").splitlines()
    assert lines[0] == f"{tmp_path.as_posix()}/m.py:1:1: LF900 x.parked: parked on x"
    assert "LF900: confirm at run time with find_retained" in lines
    assert any("# leakfree: ignore[CODE]" in line for line in lines)
    assert lines[-1].startswith("1 finding in 1 file (")


def test_json_and_sarif_reports_carry_every_field(tmp_path: Path) -> None:
    result = _result(tmp_path)
    data = json.loads(render(result, "json"))
    assert data["findings"] == [
        {
            "path": f"{tmp_path.as_posix()}/m.py",
            "line": 1,
            "column": 1,
            "rule": "LF900",
            "level": "warning",
            "symbol": "x.parked",
            "message": "parked on x",
        }
    ]
    assert data["files"] == 1 and data["rules"]["LF900"]["confirm"] == "find_retained"
    sarif = json.loads(render(result, "sarif"))
    assert sarif["version"] == "2.1.0"
    run = sarif["runs"][0]
    assert [r["id"] for r in run["tool"]["driver"]["rules"]] == ["LF900", "LF901"]
    (finding,) = run["results"]
    assert finding["ruleId"] == "LF900" and finding["ruleIndex"] == 0
    region = finding["locations"][0]["physicalLocation"]["region"]
    assert region == {"startLine": 1, "startColumn": 1}
    with pytest.raises(ValueError, match=r"render\(fmt='xml'\)"):
        render(result, "xml")


def _cli(args: Iterable[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(["scan", *args])
    except SystemExit as e:  # argparse's usage errors
        rc = int(e.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_exit_status_is_0_clean_and_2_on_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path, {"clean.py": "x = 1\n"})
    rc, out, _ = _cli([str(tmp_path / "clean.py")], capsys)
    assert rc == 0 and out.startswith("0 findings in 1 file")
    rc, _, err = _cli([str(tmp_path / "missing.py")], capsys)
    assert rc == 2 and "no such file or folder" in err
    rc, _, err = _cli([str(tmp_path), "--select", "LF999"], capsys)
    assert rc == 2 and "--select LF999: no such rule" in err
    rc, _, err = _cli([], capsys)
    assert rc == 2 and "give at least one PATH_OR_PACKAGE" in err
    rc, _, err = _cli([str(tmp_path), "--format", "xml"], capsys)
    assert rc == 2 and "invalid choice" in err


def test_scanning_imports_neither_torch_nor_the_scanned_code(tmp_path: Path) -> None:
    import subprocess

    write(tmp_path, {"boom/__init__.py": "raise SystemExit('imported')\n", "boom/m.py": "x = 1\n"})
    code = (
        "import sys; from leakfree.__main__ import main; rc = main(['scan', 'boom.m']); "
        "print(rc, 'torch' in sys.modules, 'boom' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={"PYTHONPATH": f"{tmp_path}:{Path(__file__).resolve().parents[1]}", "PATH": ""},
    )
    assert done.stdout.splitlines()[-1] == "0 False False", done.stderr


def test_forked_workers_find_what_one_process_finds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from leakfree.scan import _run

    files = {f"m{i}.py": "x.parked = 1\n" if i % 3 else "restore(ctx)\n" for i in range(12)}
    files["helpers.py"] = "def restore(ctx):\n    ctx.parked = None\n"
    files["bad.py"] = "x.parked = (\n"
    write(tmp_path, files)
    one = scan([str(tmp_path)], rules=RULES, jobs=1)
    monkeypatch.setattr(_run, "PARALLEL_FROM", 1)
    forked = scan([str(tmp_path)], rules=RULES, jobs=2)
    assert forked.findings == one.findings and len(one.findings) == 13
    assert forked.unparsed == one.unparsed and len(one.unparsed) == 1


def test_leakfree_scans_clean_but_for_its_deliberate_leaks() -> None:
    # The demo's side-table offloader and the Fast-LLM loss shape leak on purpose; they
    # carry suppression comments, which this also proves work on real code.
    root = Path(__file__).resolve().parents[1] / "leakfree"
    assert scan([str(root)], jobs=1).findings == []
    texts = [(root / "_demo.py").read_text(), (root / "_shapes.py").read_text()]
    assert "# leakfree: ignore[LF004]" in texts[0] and "# leakfree: ignore[LF001]" in texts[1]
