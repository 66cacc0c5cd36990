"""What the scanner passes around: a parsed file, the scanned tree, a rule, a finding.

Nothing here imports torch or the code being scanned: a file is read as text and parsed
with :mod:`ast`, so a package that needs CUDA to import (Transformer Engine) scans on any
machine.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from leakfree.scan._syntax import defined, statements

T = TypeVar("T")


@dataclass(frozen=True, order=True)
class ScanFinding:
    """One place a rule flags: ``path:line:col: RULE symbol: message``.

    ``symbol`` names what holds the memory (``Class.attr``, ``self.history``,
    ``context.losses``); ``message`` says why and what to do.
    """

    path: str
    line: int
    col: int
    rule: str
    symbol: str
    message: str
    #: ``"warning"``: a leak; ``"note"``: memory held that lives anyway (a parameter, a
    #: weight, a small RNG state): worth knowing, not failing the scan for
    level: str = "warning"
    #: why the rule believes it, in one line (the text report shows this, not the advice)
    evidence: str = ""

    def __str__(self) -> str:
        note = " (note)" if self.level == NOTE else ""
        return (
            f"{self.path}:{self.line}:{self.col}: {self.rule}{note} {self.symbol}: {self.message}"
        )


WARNING = "warning"
NOTE = "note"


@dataclass
class Source:
    """One parsed file. ``module`` is its dotted name where it lies in a package."""

    path: str
    text: str
    tree: ast.Module
    module: str = ""

    @property
    def lines(self) -> list[str]:
        """The text's lines (split when asked: most files never are)."""
        return self.text.splitlines()

    @property
    def package(self) -> str:
        """The dotted package this file lies in (relative imports start here)."""
        if self.path.endswith("__init__.py"):
            return self.module
        return self.module.rpartition(".")[0]

    def finding(
        self,
        node: ast.AST,
        rule: str,
        symbol: str,
        message: str,
        level: str = "warning",
        evidence: str = "",
    ) -> ScanFinding:
        """A finding at ``node``'s position in this file; ``evidence`` is its one line of
        why (the message's first clause when not given)."""
        return ScanFinding(
            self.path,
            getattr(node, "lineno", 1),
            getattr(node, "col_offset", 0) + 1,
            rule,
            symbol,
            message,
            level,
            evidence or message.split("; ", 1)[0],
        )


FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef
#: ``def name(`` / ``class Name``: where a text may define ``name`` (a match inside a word,
#: a comment or a string only costs a parse; anchors made the pattern ten to twenty times
#: slower)
_DEF = re.compile(r"def[ \t]+(\w+)[ \t]*\(|class[ \t]+(\w+)")


def _applied(text: str) -> set[str]:
    """The names ``X`` of every ``X.apply`` in ``text``: where a text may call an autograd
    Function. Found from each ``.apply`` backwards (a pattern starting with ``\\w+``
    tries every letter of the text: twenty times slower)."""
    found: set[str] = set()
    i = text.find(".apply")
    while i != -1:
        end = i + 6
        if end == len(text) or not (text[end].isalnum() or text[end] == "_"):
            j = i
            while j and (text[j - 1].isalnum() or text[j - 1] == "_"):
                j -= 1
            if j < i:
                found.add(text[j:i])
        i = text.find(".apply", end)
    return found


def parse(path: str, text: str, module: str = "") -> Source:
    """Parse ``text`` (raises :class:`SyntaxError`); invalid escape sequences in old code
    are not the scanner's business, so their warnings are silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        tree = ast.parse(text, filename=path)
    return Source(path, text, tree, module)


@dataclass
class Project:
    """Everything scanned in one run, so a rule can follow a call into a helper defined in
    another scanned file (``restore_from_func_ctx(ctx)``), and the files of the same
    package that a scanned file imports from (``context``: read for helpers, never
    checked, as when pre-commit hands over one changed file).

    Files are parsed on demand: :meth:`helpers` looks a name up in the text of every file
    (``def name``) and parses only the files that define it; those stay parsed. A file
    parsed only to be checked is dropped again with :meth:`release`, so a scan of a large
    tree never holds every syntax tree at once. Names are not resolved through imports:
    every function or method of that name counts.
    """

    texts: dict[str, tuple[str, str]] = field(default_factory=dict)  #: path -> (text, module)
    parsed: dict[str, Source | None] = field(default_factory=dict)  #: None: did not parse
    #: path -> why it did not parse (``SyntaxError: invalid syntax (line 3)``)
    errors: dict[str, str] = field(default_factory=dict)
    context: set[str] = field(default_factory=set)  #: paths read for helpers only
    _helpers: dict[str, list[tuple[Source, FunctionNode]]] = field(default_factory=dict)
    _classes: dict[str, list[tuple[Source, ast.ClassDef]]] = field(default_factory=dict)
    #: class name -> the paths whose text defines one (built on the first look-up)
    _class_where: dict[str, list[str]] | None = None
    #: class name -> the paths whose text calls its ``.apply`` (built on the first look-up)
    _apply_where: dict[str, list[str]] | None = None
    _defs: dict[str, dict[str, list[FunctionNode]]] = field(default_factory=dict)
    #: function name -> the paths whose text defines one (built on the first look-up)
    _where: dict[str, list[str]] | None = None
    #: dotted module name -> its path (built on the first look-up)
    _modules: dict[str, str] | None = None
    #: path -> (what, id(node)) -> value: dropped with the file in one step
    _memo: dict[str, dict[tuple[str, int], object]] = field(default_factory=dict)
    #: paths a class look-up parsed: kept, as helper files are
    _kept: set[str] = field(default_factory=set)

    def add(self, source: Source) -> None:
        """Add an already parsed file."""
        self.texts[source.path] = (source.text, source.module)
        self.parsed[source.path] = source
        self._forget_lookups()

    def add_text(self, path: str, text: str, module: str = "", *, context: bool = False) -> None:
        """Add a file to be parsed when a rule or a helper look-up needs it; a ``context``
        file is only read for helpers."""
        self.texts[path] = (text, module)
        if context:
            self.context.add(path)
        self._forget_lookups()

    def _forget_lookups(self) -> None:
        # a new file may define a helper already looked up
        self._where = None
        self._class_where = None
        self._apply_where = None
        self._modules = None
        self._helpers.clear()
        self._classes.clear()

    def module(self, name: str) -> Source | None:
        """The parsed file of the scanned tree (or its context) whose dotted module name is
        ``name`` (``pkg.base`` for ``pkg/base.py`` or ``pkg/base/__init__.py``); None when
        it is not there or does not parse."""
        if self._modules is None:
            self._modules = {module: path for path, (_, module) in self.texts.items() if module}
        path = self._modules.get(name)
        return self.source(path) if path is not None else None

    def source(self, path: str) -> Source | None:
        """The parsed file (None if it does not parse)."""
        if path not in self.parsed:
            text, module = self.texts[path]
            try:
                self.parsed[path] = parse(path, text, module)
            except (SyntaxError, ValueError) as e:  # ValueError: a null byte in the text
                self.parsed[path] = None
                self.errors[path] = f"{type(e).__name__}: {e}"
        return self.parsed[path]

    def close(self) -> None:
        """Drop every tree, memo and look-up: what a rule memoised may point back at the
        project (a cycle), and the collector would walk every tree left to find it."""
        for table in (self.parsed, self._memo, self._helpers, self._defs, self.texts):
            table.clear()
        self._classes.clear()
        self._kept.clear()
        self._where = self._modules = self._class_where = self._apply_where = None

    def release(self, path: str) -> None:
        """Forget ``path``'s syntax tree, and what rules memoised about it, unless a helper
        look-up uses it."""
        if path in self._defs or path in self._kept:
            return
        self.parsed.pop(path, None)
        self._memo.pop(path, None)

    def memo(self, what: str, source: Source, node: ast.AST, compute: Callable[[], T]) -> T:
        """``compute()``, once per run for ``node`` of ``source`` (dropped with the file)."""
        known = self._memo.setdefault(source.path, {})
        key = (what, id(node))
        if key not in known:
            known[key] = compute()
        return known[key]  # type: ignore[return-value]

    def defs(self, source: Source) -> dict[str, list[FunctionNode]]:
        """The functions (and methods, nested ones too) ``source`` defines, by name."""
        found = self._defs.get(source.path)
        if found is None:
            found = {}
            for node in defined(source.tree.body):
                found.setdefault(node.name, []).append(node)
            self._defs[source.path] = found
        return found

    def helpers(self, name: str) -> Iterator[tuple[Source, FunctionNode]]:
        """The functions (and methods) named ``name`` defined anywhere in the project."""
        found = self._helpers.get(name)
        if found is None:
            found = []
            for path in self._index()[0].get(name, ()):
                source = self.source(path)
                if source is not None:
                    found += [(source, fn) for fn in self.defs(source).get(name, ())]
            self._helpers[name] = found
        yield from found

    def appliers(self, cls: str) -> list[str]:
        """The paths whose text calls ``cls.apply`` (an index built on the first look-up
        from the texts that call any ``.apply``)."""
        if self._apply_where is None:
            self._apply_where = {}
            for path, (text, _) in self.texts.items():
                if ".apply" in text:
                    for name in _applied(text):
                        self._apply_where.setdefault(name, []).append(path)
        return self._apply_where.get(cls, [])

    def _index(self) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
        """Function name -> the paths whose text defines one, and the same for classes:
        one pass over every text, on the first look-up."""
        if self._where is None or self._class_where is None:
            self._where, self._class_where = {}, {}
            for path, (text, _) in self.texts.items():
                for fn, cls in set(_DEF.findall(text)):
                    into = self._where if fn else self._class_where
                    into.setdefault(fn or cls, []).append(path)
        return self._where, self._class_where

    def classes(self, name: str) -> list[tuple[Source, ast.ClassDef]]:
        """The classes named ``name`` defined anywhere in the project (nested ones too)."""
        found = self._classes.get(name)
        if found is None:
            found = []
            for path in self._index()[1].get(name, ()):
                source = self.source(path)
                if source is not None:
                    self._kept.add(path)
                    found += [
                        (source, node)
                        for node in statements(source.tree)
                        if isinstance(node, ast.ClassDef) and node.name == name
                    ]
            self._classes[name] = found
        return found


Check = Callable[[Source, Project], Iterable[ScanFinding]]


@dataclass(frozen=True)
class ScanRule:
    """A rule: its code (``LF001``), a short name, what it finds, the runtime tool that
    confirms a finding, and its check (one call per file; the project is for following
    calls)."""

    code: str
    name: str
    summary: str
    confirm: str
    check: Check
    #: the check runs only on files whose text contains one of these strings (a cheap
    #: filter before parsing; empty: every file)
    needs: tuple[str, ...] = ()
    #: what to do about a finding, in one sentence (the text report's counts show it)
    fix: str = ""

    def wants(self, text: str) -> bool:
        # substring tests beat one alternation pattern here (measured: 4x on transformers)
        return not self.needs or any(n in text for n in self.needs)
