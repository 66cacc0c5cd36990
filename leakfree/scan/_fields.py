"""Which fields of a class hold tensors, read where the class is defined in the scanned
tree: what an object kept on ctx keeps alive.

A field holds tensors when the class annotates it as a tensor (``meta: torch.Tensor``, a
dataclass or NamedTuple field ``lengths: Tensor``, ``Optional[Tensor]``, ``List[Tensor]``),
in its body or on ``self`` in a method (``self.buf: torch.Tensor = ...``), or when a
method assigns it one (``self.buf = torch.empty(n)``). A field is *small* when every
value a method gives it is a tensor of a few numbers whatever the data
(``torch.zeros_like(torch.empty(1))``): :func:`~leakfree.scan._tensors.few`. A class is
found by name in the file first, then anywhere in the scanned tree (every class of that
name must agree, else nothing is said); its bases in the same file are read too.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from leakfree.scan._callables import imported_names
from leakfree.scan._flow import Flow
from leakfree.scan._model import Project, Source
from leakfree.scan._syntax import positional, statements, tensor_annotation
from leakfree.scan._tensors import TensorEvidence, few


@dataclass(frozen=True)
class Field:
    """A field that holds tensors, whether it is small, and why it is believed to."""

    name: str
    small: bool
    why: str


class Fields:
    """The tensor fields of the classes of the scanned tree, by name, read once each."""

    def __init__(self, project: Project) -> None:
        self.project = project
        self._memo: dict[tuple[str, str], dict[str, Field] | None] = {}

    def of(self, source: Source, name: str) -> dict[str, Field] | None:
        """Field name -> :class:`Field` for the class ``name`` as ``source`` sees it; None
        when no class of that name is in the tree (or several that disagree)."""
        key = (source.path, name)
        if key not in self._memo:
            self._memo[key] = self._read(source, name)
        return self._memo[key]

    def carrier(self, source: Source, name: str) -> bool:
        """Is the class ``name`` a data carrier: a dataclass, a NamedTuple (or TypedDict),
        or a class whose only methods are dunders and properties? A kept object of a
        class with behaviour (a device mesh, a manager) is as often long-lived."""
        found = [(source, c) for c in _classes(source, name)] or self.project.classes(name)
        return bool(found) and all(_carrier(c) for _, c in found)

    def _read(self, source: Source, name: str) -> dict[str, Field] | None:
        local = _classes(source, name)
        found = [(source, c) for c in local] or self.project.classes(name)
        if not found:
            return None
        readings = [self._fields(src, cls, set()) for src, cls in found]
        first = readings[0]
        if any(r.keys() != first.keys() for r in readings[1:]):
            return None  # several classes of that name, and they differ
        return first

    def _fields(self, source: Source, cls: ast.ClassDef, seen: set[str]) -> dict[str, Field]:
        seen.add(cls.name)
        out: dict[str, Field] = {}
        for base in cls.bases:  # bases of the same file first: the class's own win
            if isinstance(base, ast.Name) and base.id not in seen:
                for b in _classes(source, base.id):
                    out.update(self._fields(source, b, seen))
        for stmt in cls.body:
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and tensor_annotation(stmt.annotation)
            ):
                why = f"{cls.name}.{stmt.target.id} is annotated {ast.unparse(stmt.annotation)}"
                out[stmt.target.id] = Field(stmt.target.id, False, why)
        assigned: dict[str, list[ast.AST]] = {}
        for stmt in cls.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._method(source, cls, stmt, out, assigned)
        names = imported_names(self.project, source)
        for field_name, values in assigned.items():
            given = [v for v in values if not (isinstance(v, ast.Constant) and v.value is None)]
            if field_name in out and given:
                small = all(few(v, names, {}) for v in given)
                out[field_name] = Field(field_name, small, out[field_name].why)
        return out

    def _method(
        self,
        source: Source,
        cls: ast.ClassDef,
        fn: ast.FunctionDef | ast.AsyncFunctionDef,
        out: dict[str, Field],
        assigned: dict[str, list[ast.AST]],
    ) -> None:
        """Fields ``fn`` annotates or assigns a tensor on its ``self``."""
        params = positional(fn)
        if not params:
            return
        me = params[0]
        flow = Flow(fn)
        evidence: TensorEvidence | None = None
        for step in flow.steps:
            t = step.target
            if not (
                step.how == "="
                and isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name)
                and t.value.id == me
            ):
                continue
            assigned.setdefault(t.attr, []).append(step.value)
            node = step.node
            if isinstance(node, ast.AnnAssign) and tensor_annotation(node.annotation):
                why = f"{cls.name}.{t.attr} is annotated {ast.unparse(node.annotation)}"
                out.setdefault(t.attr, Field(t.attr, False, why))
                continue
            if evidence is None:
                names = imported_names(self.project, source)
                evidence = TensorEvidence(fn, names, set(), flow=flow, inputs=False, returned=False)
            if evidence.holds(step.value, weak=False):
                why = f"{cls.name}.{fn.name} sets self.{t.attr} = {ast.unparse(step.value)}"
                out.setdefault(t.attr, Field(t.attr, False, why[:120]))


def _classes(source: Source, name: str) -> list[ast.ClassDef]:
    return [n for n in statements(source.tree) if isinstance(n, ast.ClassDef) and n.name == name]


_RECORD_BASES = ("NamedTuple", "TypedDict")


def _carrier(cls: ast.ClassDef) -> bool:
    decorators = [ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in cls.decorator_list]
    if any(d.rpartition(".")[2] in ("dataclass", "define", "frozen", "s") for d in decorators):
        return True
    if any(ast.unparse(b).rpartition(".")[2] in _RECORD_BASES for b in cls.bases):
        return True
    methods = [s for s in cls.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return all(
        m.name.startswith("__") or any(ast.unparse(d) == "property" for d in m.decorator_list)
        for m in methods
    )
