"""Run the rules over files: parse, index the tree, check, drop suppressed findings.

All files are parsed first, so that a rule can follow a call into a helper defined in
another scanned file; then each rule checks each file. A ``# leakfree: ignore[LF001]``
comment on a flagged line drops that rule's finding there (``# leakfree: ignore`` drops
every rule's).
"""

from __future__ import annotations

import contextlib
import gc
import io
import multiprocessing as mp
import os
import re
import time
import tokenize
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import leakfree._args as _args
from leakfree.scan._baseline import load as load_baseline
from leakfree.scan._baseline import new_only
from leakfree.scan._imports import add_imported, module_of
from leakfree.scan._locate import Target, UsageError, python_files, resolve
from leakfree.scan._model import WARNING, Project, ScanFinding, ScanRule, Source

_SUPPRESS = re.compile(r"#\s*leakfree:\s*ignore\b(?:\[([^\]]*)\])?")
#: in a suppression's set of codes: every rule
ALL = "*"


def suppressions(text: str) -> dict[int, set[str]]:
    """Line -> rule codes suppressed there by ``# leakfree: ignore[...]`` comments (real
    comments only, read with :mod:`tokenize`, so the text inside a string never counts)."""
    if "leakfree:" not in text:
        return {}
    out: dict[int, set[str]] = {}
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type != tokenize.COMMENT:
                continue
            match = _SUPPRESS.search(token.string)
            if match is None:
                continue
            codes = match.group(1)
            chosen = {c.strip().upper() for c in codes.split(",") if c.strip()} if codes else {ALL}
            out.setdefault(token.start[0], set()).update(chosen or {ALL})
    except (tokenize.TokenError, SyntaxError):
        pass  # the file did not parse either; nothing is reported for it
    return out


def choose_rules(
    rules: Sequence[ScanRule], select: Iterable[str] = (), ignore: Iterable[str] = ()
) -> list[ScanRule]:
    """The rules chosen by ``select`` (default: all) minus ``ignore``; a code may be a
    prefix (``LF00``). Raises :class:`UsageError` naming a code that matches no rule."""
    known = [r.code for r in rules]

    def matching(option: str, codes: Iterable[str]) -> set[str]:
        out: set[str] = set()
        for code in codes:
            code = code.strip().upper()
            if not code:
                continue
            hits = {k for k in known if k.startswith(code)}
            if not hits:
                raise UsageError(f"--{option} {code}: no such rule (rules: {', '.join(known)})")
            out |= hits
        return out

    selected = matching("select", select) or set(known)
    ignored = matching("ignore", ignore)
    return [r for r in rules if r.code in selected and r.code not in ignored]


@dataclass
class ScanResult:
    """What one scan found: the findings (sorted by path, line, column, rule), how many
    files were read, those that could not be parsed (``path: reason``), the rules run and
    the seconds it took."""

    findings: list[ScanFinding] = field(default_factory=list)
    files: int = 0
    unparsed: list[str] = field(default_factory=list)
    rules: list[ScanRule] = field(default_factory=list)
    seconds: float = 0.0
    #: reported path -> the folder it is relative to (absolute; SARIF's uriBaseId)
    bases: dict[str, str] = field(default_factory=dict)
    #: findings left out because the baseline lists them (``scan(baseline=...)``)
    baselined: int = 0

    @property
    def files_per_second(self) -> float:
        return self.files / self.seconds if self.seconds > 0 else float("inf")

    @property
    def leaks(self) -> list[ScanFinding]:
        """The findings that are leaks (``warning``), not notes."""
        return [f for f in self.findings if f.level == WARNING]

    @property
    def status(self) -> int:
        """The exit status (:data:`EXIT_STATUSES`): 1 when a leak was found, else 3 when a
        file could not be read or parsed (the scan could not see into it, whatever it
        holds), else 0. Notes alone are 0."""
        if self.leaks:
            return 1
        return 3 if self.unparsed else 0


#: every exit status of ``leakfree scan``, and what it means (``--help`` lists them)
EXIT_STATUSES = {
    0: "no leak found (notes alone are 0)",
    1: "leaks found",
    2: "usage error (a path or package that does not exist, an unknown rule)",
    3: "no leak found, but files could not be read or parsed, so were not checked (listed)",
}


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while rules run: syntax trees are millions
    of objects, and each collection walks every one still alive (26 of torch's 36 CPU-s
    were the collector). Trees have no cycles: reference counting frees each one when its
    file is released. The collector is restored, never forced, afterwards."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _display(path: Path, base: Path) -> str:
    try:
        return path.relative_to(base).as_posix() if base != Path(".") else path.as_posix()
    except ValueError:
        return path.as_posix()


def _module_name(path: Path, target: Target) -> str:
    if not target.module:
        return ""
    relative = path.relative_to(target.base).with_suffix("")
    parts = list(relative.parts)
    if parts and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


#: below this many files to parse, one process (a pool costs more than it saves)
PARALLEL_FROM = 64
_WORK: tuple[Project, Sequence[ScanRule]] | None = None  #: what forked workers inherit


def _check(
    project: Project, paths: Iterable[str], rules: Sequence[ScanRule]
) -> tuple[list[ScanFinding], list[str]]:
    """Findings in ``paths`` (suppressed ones dropped), and the paths that did not parse
    with the reason (``path: SyntaxError: ...``). Every file is parsed, whether or not a
    rule wants it: a file the scanner cannot read is never passed over in silence."""
    findings: set[ScanFinding] = set()
    unparsed = []
    for path in paths:
        source = project.source(path)
        if source is None:
            unparsed.append(f"{path}: {project.errors.get(path, 'did not parse')}")
            continue
        text = source.text
        quiet: dict[int, set[str]] | None = None
        for rule in rules:
            if not rule.wants(text):
                continue
            if quiet is None:
                quiet = suppressions(text)
            for finding in rule.check(source, project):
                codes = quiet.get(finding.line, ())
                if finding.rule not in codes and ALL not in codes:
                    findings.add(finding)
        project.release(path)
    return sorted(findings), unparsed


def _check_part(paths: list[str]) -> tuple[list[ScanFinding], list[str]]:
    work = _WORK
    if work is None:  # only _check_all's forked workers call this, with _WORK set
        raise RuntimeError("leakfree scan: a worker started without the project to check")
    return _check(work[0], paths, work[1])


def _check_all(
    project: Project, rules: Sequence[ScanRule], jobs: int
) -> tuple[list[ScanFinding], list[str]]:
    """:func:`_check` over every file, in ``jobs`` forked processes when there is enough
    to parse (``ast.parse`` is most of the time: torch's tree is 46 MB of source). Each
    worker inherits the project's texts and parses on demand, helpers included."""
    global _WORK
    paths = [p for p in project.texts if p not in project.context]
    if jobs <= 1 or len(paths) < PARALLEL_FROM or "fork" not in mp.get_all_start_methods():
        return _check(project, paths, rules)
    parts = min(len(paths), jobs * 4)  # interleaved slices: big files spread out
    _WORK = (project, rules)
    try:
        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("fork")) as pool:
            done = list(pool.map(_check_part, [paths[i::parts] for i in range(parts)]))
    finally:
        _WORK = None
    return (
        sorted({f for found, _ in done for f in found}),
        sorted({p for _, bad in done for p in bad}),
    )


def scan_sources(sources: Sequence[Source], rules: Sequence[ScanRule]) -> list[ScanFinding]:
    """Check ``sources`` (already parsed) with ``rules``; suppressed findings dropped."""
    project = Project()
    for source in sources:
        project.add(source)
    return _check(project, [s.path for s in sources], rules)[0]


def scan(
    paths: Iterable[str],
    *,
    rules: Sequence[ScanRule] | None = None,
    select: Iterable[str] = (),
    ignore: Iterable[str] = (),
    exclude: Iterable[str] = (),
    jobs: int | None = None,
    baseline: str | os.PathLike[str] | None = None,
) -> ScanResult:
    """Scan files, folders and installed packages (by import name, never imported), in
    ``jobs`` processes (default: one per CPU) when there are many files to parse. With a
    ``baseline`` (a JSON report of an earlier scan), only the findings it does not list
    are kept (:mod:`~leakfree.scan._baseline`: matched by rule, path and symbol).

    Raises :class:`UsageError` (before reading anything) for a path or package that does
    not exist, a rule code that matches no rule, or a baseline that is not a scan's JSON
    report. Every file is parsed: one that cannot be read or parsed (bad encoding, a syntax
    error, syntax newer than this interpreter) is listed in :attr:`ScanResult.unparsed`
    with the reason, not raised, and makes the status 3 unless a leak was found.
    """
    call = "scan"
    paths = _args.items(call, "paths", paths, (str, os.PathLike), "paths or package names")
    select, ignore, exclude = (
        _args.items(call, name, value, (str,), "str")
        for name, value in (("select", select), ("ignore", ignore), ("exclude", exclude))
    )
    _args.count(call, "jobs", jobs, 1, none=True, unit="processes")
    if baseline is not None and not isinstance(baseline, (str, os.PathLike)):
        raise TypeError(
            f"scan(baseline={baseline!r}): expected a path to a JSON report of an earlier "
            "scan; write one with `leakfree scan PATH --format json -o FILE`"
        )
    if rules is None:
        from leakfree.scan.rules import RULES

        rules = RULES
    chosen = choose_rules(rules, select, ignore)
    known = load_baseline(baseline) if baseline is not None else None
    targets = resolve(paths)
    started = time.perf_counter()
    result = ScanResult(rules=chosen)
    project = Project()
    seen: set[Path] = set()
    for target in targets:
        base = str(target.base.resolve())
        for path in python_files(target, exclude):
            if len(targets) > 1:  # the same file reached through two targets: once
                key = path.resolve()
                if key in seen:
                    continue
                seen.add(key)
            result.files += 1
            shown = _display(path, target.base)
            try:
                with tokenize.open(path) as f:  # honours the file's coding cookie
                    text = f.read()
            except (OSError, SyntaxError, UnicodeDecodeError) as e:
                result.unparsed.append(f"{shown}: {type(e).__name__}: {e}")
                continue
            project.add_text(shown, text, _module_name(path, target) or module_of(path))
            result.bases[shown] = base
    for target in targets:
        if target.path.is_file():  # one file of a package: read what it imports from it
            add_imported(project, target.path)
    if jobs is None:
        jobs = os.cpu_count() or 1
    with _collector_paused():
        result.findings, unparsed = _check_all(project, chosen, jobs)
        # freed while the collector is off: enabled again with the helper files' trees
        # still alive, its first pass would walk every one of them (3 CPU-s of 14 on
        # transformers)
        project.close()
    result.unparsed = sorted([*result.unparsed, *unparsed])
    if known is not None:
        result.findings, result.baselined = new_only(result.findings, known)
    result.seconds = time.perf_counter() - started
    return result
