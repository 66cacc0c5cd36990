"""What the callers of an autograd Function hand it: the ``Fn.apply(...)`` calls of the
scanned tree (also through an alias, ``fn = Fn.apply``), argument by argument, judged on
the caller's own evidence.

An annotation is the author's word; the calls are what runs. mmcv 2.2.0 annotates
``im2col_step: torch.Tensor`` and its one caller hands it the module's int; ColossalAI
0.5.1 annotates ``activated_experts: int`` and every caller hands it an element of a
tensor. When every call found agrees (each argument at that position is a number, or each
is a tensor), that wins over the annotation; with no call found, or calls that disagree
or cannot be read, the annotation stands.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from leakfree.scan._callables import imported_names
from leakfree.scan._model import FunctionNode, Project, Source
from leakfree.scan._syntax import (
    functions,
    own_nodes,
    plain_annotation,
    positional,
    statements,
    tail,
)
from leakfree.scan._tensors import TensorEvidence

SCALAR, TENSOR = "scalar", "tensor"
#: builtins whose result is a number
_NUMBERS = frozenset({"int", "float", "len", "round", "bool", "abs", "max", "min", "sum"})


class Callers:
    """The verdict of the callers of each Function class, by name, read once each."""

    def __init__(self, project: Project) -> None:
        self.project = project
        self._memo: dict[str, list[dict[int, str | None]]] = {}
        self._files: dict[str, _FileCalls] = {}

    def verdict(self, cls: str, position: int) -> str | None:
        """:data:`SCALAR` or :data:`TENSOR` when every ``cls.apply(...)`` call of the
        scanned tree hands that at ``position`` (forward's inputs after ctx, from 0); None
        when no call is found, or they disagree or cannot be read."""
        if cls not in self._memo:
            self._memo[cls] = list(self._calls(cls))
        said = {call.get(position) for call in self._memo[cls]}
        return said.pop() if len(said) == 1 else None

    def _calls(self, cls: str) -> Iterator[dict[int, str | None]]:
        for path in self.project.appliers(cls):
            calls = self._files.get(path)
            if calls is None:
                source = self.project.source(path)
                if source is None:
                    continue
                calls = self._files[path] = _FileCalls(source, self.project)
            yield from calls.of(cls)


class _FileCalls:
    """The ``X.apply(...)`` calls of one file (and of names bound to ``X.apply``), found
    in one walk, each judged by the function that makes it."""

    def __init__(self, source: Source, project: Project) -> None:
        self.names = imported_names(project, source)
        tree = source.tree
        aliases = {  # fn = Cls.apply
            t.id: applied
            for n in statements(tree)
            if isinstance(n, ast.Assign) and (applied := _apply_of(n.value)) is not None
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        #: class name -> (the call, the function making it, the class that is a method of)
        self.calls: dict[str, list[tuple[ast.Call, FunctionNode, ast.ClassDef | None]]] = {}
        for fn, cls in functions(tree):
            for n in own_nodes(fn):
                if not isinstance(n, ast.Call):
                    continue
                name = _apply_of(n.func)
                if name is None and isinstance(n.func, ast.Name):
                    name = aliases.get(n.func.id)
                if name is not None:
                    self.calls.setdefault(name, []).append((n, fn, cls))
        self._judges: dict[int, _Judge] = {}

    def of(self, cls: str) -> Iterator[dict[int, str | None]]:
        """What each call of ``cls.apply`` in this file hands it (a call at module level,
        or with ``*args``, cannot be read: an empty verdict). A nested function's calls are
        judged by the nested function, whose class is not known: its ``self.x`` are not
        read."""
        for call, fn, owner in self.calls.get(cls, ()):
            if any(isinstance(a, ast.Starred) for a in call.args):
                yield {}
                continue
            judge = self._judges.get(id(fn))
            if judge is None:
                judge = self._judges[id(fn)] = _Judge(fn, owner, self.names)
            yield {i: judge.kind(a) for i, a in enumerate(call.args)}


def _apply_of(e: ast.AST) -> str | None:
    """``Cls`` for ``Cls.apply`` (or ``mod.Cls.apply``)."""
    if isinstance(e, ast.Attribute) and e.attr == "apply":
        return tail(e.value) or None
    return None


class _Judge:
    """What a caller hands a Function, on the caller's own evidence."""

    def __init__(self, fn: FunctionNode, cls: ast.ClassDef | None, names: dict[str, str]):
        self.fn = fn
        self.names = names
        self.cls = cls
        self._evidence: TensorEvidence | None = None

    def kind(self, arg: ast.expr) -> str | None:
        if self._scalar(arg, self.fn, depth=0):
            return SCALAR
        if isinstance(arg, ast.Constant):
            return None
        if self._evidence is None:  # read only for an argument a number it is not
            self._evidence = TensorEvidence(
                self.fn, self.names, set(), inputs=False, returned=False
            )
        if self._evidence.holds(arg, weak=False):
            return TENSOR
        return None

    def _scalar(self, e: ast.AST, fn: FunctionNode, depth: int) -> bool:
        if isinstance(e, ast.Constant):
            return isinstance(e.value, (int, float, bool, str)) or e.value is None
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name):
            return e.func.id in _NUMBERS
        if isinstance(e, ast.Name):
            return _plain_parameter(fn, e.id)
        if (
            isinstance(e, ast.Attribute)
            and isinstance(e.value, ast.Name)
            and positional(fn)[:1] == [e.value.id]
            and self.cls is not None
            and depth == 0
        ):
            # ``self.im2col_step``: every value the class's methods give it is a number
            values = list(_self_values(self.cls, e.attr))
            return bool(values) and all(self._scalar(v, m, depth + 1) for m, v in values)
        return False


def _plain_parameter(fn: FunctionNode, name: str) -> bool:
    """Is ``name`` a parameter of ``fn`` annotated as a number (or defaulting to one)?"""
    a = fn.args
    every = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    defaults = dict(zip([p.arg for p in [*a.posonlyargs, *a.args]][-len(a.defaults) :], a.defaults))
    defaults.update({p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
    for p in every:
        if p.arg == name:
            default = defaults.get(name) if a.defaults or a.kw_defaults else None
            numeric = isinstance(default, ast.Constant) and isinstance(
                default.value, (int, float, bool)
            )
            return plain_annotation(p.annotation) or numeric
    return False


def _self_values(cls: ast.ClassDef, attr: str) -> Iterator[tuple[FunctionNode, ast.expr]]:
    """(method, value) for each ``self.attr = value`` in the class's methods."""
    for stmt in cls.body:
        if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        me = positional(stmt)[:1]
        for n in ast.walk(stmt):
            if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None:
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                for t in targets:
                    if (
                        isinstance(t, ast.Attribute)
                        and t.attr == attr
                        and isinstance(t.value, ast.Name)
                        and [t.value.id] == me
                    ):
                        yield stmt, n.value
