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
from leakfree.scan import ScanFinding, ScanResult, render, scan
from leakfree.scan._locate import UsageError
from leakfree.scan._model import Project, ScanRule, Source
from leakfree.scan._run import choose_rules, suppressions
from tests._scan import CASES


def _flag_parked(source: Source, project: Project) -> Iterator[ScanFinding]:
    """A rule for the machinery's tests: every ``<name>.parked = ...`` assignment."""
    for node in ast.walk(source.tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr == "parked":
                    yield source.finding(target, "LF900", "x.parked", "parked on x")


def _flag_helper_calls(source: Source, project: Project) -> Iterator[ScanFinding]:
    """Flags a call whose helper, defined in any scanned file, assigns ``.parked``."""
    for node in ast.walk(source.tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            for where, helper in project.helpers(node.func.id):
                nodes = ast.walk(helper)
                if any(isinstance(n, ast.Attribute) and n.attr == "parked" for n in nodes):
                    yield source.finding(node, "LF901", node.func.id, f"parks ({where.path})")


PARKED = ScanRule(
    "LF900", "parked", "x.parked =", "find_retained", _flag_parked, needs=(".parked",)
)
HELPED = ScanRule(
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
    from leakfree.scan._run import scan_sources

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


def test_a_helper_in_another_file_is_followed_and_every_file_is_parsed(
    tmp_path: Path,
) -> None:
    write(
        tmp_path,
        {
            "a.py": "restore(ctx)\n",
            "helpers/b.py": "def restore(ctx):\n    ctx.parked = None\n",
            "c.py": "def unrelated(:\n",  # does not parse, though no rule needs it
        },
    )
    result = scan([str(tmp_path)], rules=RULES, select=["LF901"])
    assert codes(result) == [("a.py", 1, "LF901")]  # b.py's own text is not "restore("
    assert result.findings[0].message.endswith(f"({tmp_path.as_posix()}/helpers/b.py)")
    # no rule wanted c.py, and it is listed all the same: a skipped file is never silent
    assert result.files == 3 and result.status == 1
    assert [u.split(": ", 1)[1] for u in result.unparsed] == [
        "SyntaxError: invalid syntax (c.py, line 1)"
    ]


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


def test_text_report_groups_by_file_and_holder_then_counts_and_how_to_confirm(
    tmp_path: Path,
) -> None:
    lines = render(_result(tmp_path), "text").splitlines()
    assert lines[:3] == [f"{tmp_path.as_posix()}/m.py", "  x.parked", "    1:1 LF900 parked on x"]
    assert "LF900 parked: 1 warning" in lines
    assert "  confirm at run time with find_retained" in lines
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
            "evidence": "parked on x",
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
    texts = [(root / "cli" / "demo.py").read_text(), (root / "_shapes.py").read_text()]
    assert "# leakfree: ignore[LF004]" in texts[0] and "# leakfree: ignore[LF001]" in texts[1]


# --- honest reporting ------------------------------------------------------------------

#: PEP 695 (3.12) syntax, not parsed on older interpreters, in a file every rule set wants
NEWER = "class Box[T](torch.autograd.Function):\n    x.parked = 1\n"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="parses on 3.12 and later")
def test_a_file_that_does_not_parse_makes_status_3_in_every_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path, {"new.py": NEWER, "clean.py": "y = 1\n"})
    result = scan([str(tmp_path)], rules=RULES)
    assert result.findings == [] and result.status == 3
    (bad,) = result.unparsed
    assert bad.startswith(f"{tmp_path.as_posix()}/new.py: SyntaxError")
    text = render(result, "text")
    assert f"not parsed: {bad}" in text and "could not be parsed and were not checked" in text
    assert json.loads(render(result, "json"))["unparsed"] == [bad]
    (run,) = json.loads(render(result, "sarif"))["runs"]
    (note,) = run["invocations"][0]["toolExecutionNotifications"]
    assert note["level"] == "error" and "not parsed, so not checked" in note["message"]["text"]
    assert run["invocations"][0]["exitCode"] == 3
    rc, out, _ = _cli([str(tmp_path)], capsys)
    assert rc == 3 and "not parsed:" in out


def test_a_syntax_error_makes_status_3_on_any_python(tmp_path: Path) -> None:
    write(tmp_path, {"bad.py": "x.parked = (\n"})
    result = scan([str(tmp_path)], rules=RULES)
    assert result.status == 3 and len(result.unparsed) == 1
    write(tmp_path, {"leak.py": "x.parked = 1\n"})
    assert scan([str(tmp_path)], rules=RULES).status == 1  # a leak outranks it


def test_notes_do_not_fail_the_scan(tmp_path: Path) -> None:
    def note(source: Source, project: Project) -> Iterator[ScanFinding]:
        yield source.finding(source.tree, "LF902", "w", "a weight", level="note")

    noted = ScanRule("LF902", "noted", "a note", "find_retained", note)
    write(tmp_path, {"m.py": "w = 1\n"})
    result = scan([str(tmp_path / "m.py")], rules=[noted])
    assert [f.level for f in result.findings] == ["note"] and result.status == 0
    assert render(result, "text").splitlines()[-1].startswith("0 findings and 1 note in 1 file")
    (run,) = json.loads(render(result, "sarif"))["runs"]
    assert run["results"][0]["level"] == "note"


def test_sarif_locations_have_a_base_and_rules_a_help_uri(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path, {"pkg/m.py": "x.parked = 1\n"})
    monkeypatch.chdir(tmp_path)
    (run,) = json.loads(render(scan(["pkg"], rules=RULES), "sarif"))["runs"]
    location = run["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"]
    assert location == {"uri": "pkg/m.py", "uriBaseId": "SRCROOT"}
    assert run["originalUriBaseIds"]["SRCROOT"]["uri"] == tmp_path.resolve().as_uri() + "/"
    from leakfree.scan.rules import RULES as REAL

    (real,) = json.loads(render(scan(["pkg"], rules=REAL), "sarif"))["runs"]
    uris = [r["helpUri"] for r in real["tool"]["driver"]["rules"]]
    assert uris[0].endswith("docs/scan.md#lf001-ctx-state-that-outlives-backward")
    assert len(uris) == 5 and all("docs/scan.md#lf00" in u for u in uris)


def test_output_file_still_prints_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(
        tmp_path,
        {
            "m.py": "total_loss = 0\nfor b in data:\n    loss = criterion(b)\n"
            "    loss.backward()\n    total_loss += loss\n"
        },
    )
    report = tmp_path / "report.sarif"
    rc, out, _ = _cli([str(tmp_path / "m.py"), "--format", "sarif", "-o", str(report)], capsys)
    assert rc == 1 and json.loads(report.read_text())["version"] == "2.1.0"
    assert out.startswith("1 finding in 1 file (") and f"report written to {report}" in out


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    import subprocess

    leak = "".join(
        f"class T{i}:\n    def step(self, loss):\n        self.history.append(loss)\n"
        for i in range(20)
    )
    write(tmp_path, {f"m{i}.py": leak for i in range(60)})  # more than a pipe holds
    reader = subprocess.run(
        f"{sys.executable} -m leakfree scan {tmp_path} | head -n 1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert reader.stdout.count("\n") == 1 and reader.stdout.strip().endswith(".py")
    assert reader.stderr == ""


def test_one_file_of_a_package_reads_the_helpers_it_imports_te_2_15_fuser() -> None:
    # pre-commit hands over only the changed file: TE 2.15's fuser releases its ctx through
    # restore_from_func_ctx in ../quantized_tensor.py (tests/scan_cases/te215 has the layout)
    from leakfree.scan.rules import RULES as REAL

    fuser = CASES / "te215/transformer_engine/pytorch/ops/fuser.py"
    result = scan([str(fuser)], rules=REAL)
    assert result.findings == [] and result.files == 1 and result.unparsed == []
    # without the helper's file to read, the same module looks like 2.13's leak
    project = Project()
    project.add_text("fuser.py", fuser.read_text(), "transformer_engine.pytorch.ops.fuser")
    source = project.source("fuser.py")
    assert source is not None
    assert [f.rule for r in REAL for f in r.check(source, project)] == ["LF001"]


def test_the_collector_is_paused_only_while_rules_run(tmp_path: Path) -> None:
    import gc

    seen: list[bool] = []

    def probe(source: Source, project: Project) -> Iterator[ScanFinding]:
        seen.append(gc.isenabled())
        return iter(())

    write(tmp_path, {"m.py": "x = 1\n"})
    assert gc.isenabled()
    scan([str(tmp_path)], rules=[ScanRule("LF903", "probe", "", "", probe)])
    assert seen == [False] and gc.isenabled()


def test_the_pre_commit_hook_runs_the_scanner_on_the_changed_files(tmp_path: Path) -> None:
    import shlex
    import subprocess

    yaml = pytest.importorskip("yaml")
    root = Path(__file__).resolve().parents[1]
    (hook,) = yaml.safe_load((root / ".pre-commit-hooks.yaml").read_text())
    assert hook["id"] == "leakfree-scan" and hook["types"] == ["python"]
    assert hook.get("pass_filenames", True)  # pre-commit appends the changed files
    fuser = CASES / "te215/transformer_engine/pytorch/ops/fuser.py"
    leaky = (
        write(
            tmp_path,
            {
                "train.py": "total_loss = 0\nfor b in data:\n    loss = f(b)\n"
                "    loss.backward()\n    total_loss += loss\n"
            },
        )
        / "train.py"
    )
    command = [*shlex.split(hook["entry"].replace("python", sys.executable, 1))]
    clean = subprocess.run([*command, str(fuser)], capture_output=True, text=True, timeout=60)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    dirty = subprocess.run(
        [*command, str(fuser), str(leaky)], capture_output=True, text=True, timeout=60
    )
    assert dirty.returncode == 1 and "train.py\n  total_loss\n    5:5 LF003" in dirty.stdout


def test_a_checked_file_s_tree_is_released_unless_a_helper_lives_in_it(tmp_path: Path) -> None:
    from leakfree.scan._run import _check

    project = Project()
    project.add_text("a.py", "restore(x)\nx.parked = 1\n")
    project.add_text("b.py", "def restore(ctx):\n    ctx.parked = None\n")
    project.add_text("c.py", "y.parked = 2\n")
    findings, unparsed = _check(project, ["a.py", "c.py"], RULES)
    assert [f.path for f in findings] == ["a.py", "a.py", "c.py"] and unparsed == []
    # a.py and c.py were checked and dropped; b.py defines the helper and stays parsed
    assert set(project.parsed) == {"b.py"}


def test_scan_help_lists_every_exit_status_a_scan_can_end_with(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from leakfree.__main__ import main

    with pytest.raises(SystemExit):
        main(["scan", "--help"])
    helped = capsys.readouterr().out
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\nclass F(torch.autograd.Function:\n")
    leaky = tmp_path / "leaky.py"
    leaky.write_text(
        "import torch\n\nclass F(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, x):\n        ctx.x = x\n        return x * 2\n\n"
        "    @staticmethod\n    def backward(ctx, g):\n        return g * 2\n"
    )
    seen = {main(["scan", str(path)]) for path in (broken, leaky)}
    with pytest.raises(SystemExit) as usage:
        main(["scan", str(tmp_path / "none.py")])
    seen.add(usage.value.code)
    capsys.readouterr()
    seen.add(0)  # a clean scan
    for status in seen:
        assert f"\n  {status}  " in helped, (status, helped)
