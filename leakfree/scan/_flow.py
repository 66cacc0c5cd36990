"""The one flow tracker: where values go inside a function.

:class:`Flow` lists every place a value moves into a name or a container, in source
order, as a :class:`Step`: assignments (split element by element where both sides are
displays), augmented and annotated assignments, ``for`` targets, ``with ... as``, walrus,
comprehension targets, and the container adds (``x.append(v)``, ``x.update(v)``...). Each
step carries the names an enclosing ``if torch.is_tensor(n)`` / ``isinstance(n, Tensor)``
proves are *not* tensors on its branch. Rules ask it two questions:

* :meth:`Flow.aliases`: the plain names bound from a name (``c = ctx``);
* :meth:`Flow.spread`: a fixpoint from seed names through every step whose value carries
  one of them (what a pack hook's tensor turns into, which locals hold tensors). The step
  that added a name is kept, so a finding can say *why* it believes what it reports.

What a value can hold is decided on top of it: tensors in
:mod:`~leakfree.scan._tensors`, losses in :mod:`~leakfree.scan.rules._loss_kinds`.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from leakfree.scan._syntax import (
    own_nodes,
    plain_annotation,
    root,
    tail,
    words,
)

#: container methods that put their (last) argument into the receiver
ADDERS = words("append extend add insert appendleft update setdefault")
#: how :meth:`Step.said` words each of them
_DONE = {
    "append": "appended",
    "appendleft": "appended",
    "extend": "added (extend)",
    "add": "added",
    "insert": "inserted",
    "update": "stored (update)",
    "setdefault": "stored (setdefault)",
}
_GUARDED = (ast.If, ast.While)


@dataclass(frozen=True)
class Step:
    """A value moving into ``target`` (a name, ``x[i]``, ``x.attr``) at ``node``.

    ``how`` is ``"="``, ``"+="`` (augmented), ``"for"``, ``"with"`` or the adder's name
    (``"append"``); ``split`` marks one element of ``a, b = f(x)`` (it gets the whole value,
    of unknown make-up); ``not_tensors`` are names a guard proves hold no tensor here.
    """

    target: ast.AST
    value: ast.AST
    node: ast.AST
    how: str
    split: bool = False
    not_tensors: frozenset[str] = frozenset()
    #: for a ``split`` element of a flat ``a, b, c = f(x)``, its position (None otherwise)
    index: int | None = None

    @property
    def name(self) -> str | None:
        """The variable the value lands in (``x`` for ``x``, ``x[i]``, ``x.attr``)."""
        base, _ = root(self.target)
        return base.id if base is not None else None

    def said(self) -> str:
        """The step in words: ``global_o gets SequenceChunk(...) appended at L774``."""
        line = getattr(self.node, "lineno", 0)
        what = short(self.value)
        if self.how == "=":
            return f"{ast.unparse(self.target)} = {what} at L{line}"
        if self.how == "for":
            return f"{ast.unparse(self.target)} iterates {what} at L{line}"
        if self.how in ("with", "+="):
            return f"{ast.unparse(self.target)} {self.how} {what} at L{line}"
        return f"{self.name} gets {what} {_DONE.get(self.how, self.how)} at L{line}"


def short(e: ast.AST, limit: int = 48) -> str:
    """Source text of ``e``, its call arguments elided when long (``f(...)``)."""
    text = ast.unparse(e)
    if len(text) <= limit:
        return text
    if isinstance(e, ast.Call):
        return f"{ast.unparse(e.func)}(...)"
    return text[: limit - 3] + "..."


class Flow:
    """The steps of one function (or module, or loop), in source order."""

    def __init__(self, scope: ast.AST) -> None:
        self.scope = scope
        self.steps: list[Step] = []
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            self._block(scope.body, frozenset())
        elif isinstance(scope, ast.stmt):
            self._statement(scope, frozenset())
        else:
            self._expression(scope, frozenset())

    def assigned(self) -> Iterator[tuple[str, ast.AST, ast.AST]]:
        """(name, value, node) for each plain ``name = value`` (walrus included), in order."""
        for s in self.steps:
            if s.how == "=" and not s.split and isinstance(s.target, ast.Name):
                yield s.target.id, s.value, s.node

    # -- collecting ----------------------------------------------------------------------
    def _block(self, body: Iterable[ast.AST], guard: frozenset[str]) -> None:
        for stmt in body:
            self._statement(stmt, guard)

    def _statement(self, s: ast.AST, guard: frozenset[str]) -> None:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return  # another scope
        if isinstance(s, _GUARDED):
            test = tensor_test(s.test)
            self._expression(s.test, guard)
            if test is not None and isinstance(test[1], ast.Name):
                positive, name = test[0], test[1].id
                self._block(s.body, guard - {name} if positive else guard | {name})
                self._block(s.orelse, guard | {name} if positive else guard - {name})
            else:
                self._block(s.body, guard)
                self._block(s.orelse, guard)
            return
        if isinstance(s, ast.Assign):
            for t in s.targets:
                self._pairs(t, s.value, s, "=", guard)
        elif isinstance(s, ast.AnnAssign) and s.value is not None:
            self.steps.append(Step(s.target, s.value, s, "=", False, guard))
        elif isinstance(s, ast.AugAssign):
            self.steps.append(Step(s.target, s.value, s, "+=", False, guard))
        elif isinstance(s, (ast.For, ast.AsyncFor)):
            self._iteration(s.target, s.iter, s, guard)
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            for item in s.items:
                if item.optional_vars is not None:
                    self.steps.append(Step(item.optional_vars, item.context_expr, s, "with"))
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            inner = getattr(s, name, None)
            if inner and isinstance(inner, list):
                self._block(inner, guard)
        for field_name, value in ast.iter_fields(s):
            if field_name in ("body", "orelse", "finalbody", "handlers", "cases"):
                continue
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.AST):
                    self._expression(child, guard)

    def _expression(self, e: ast.AST, guard: frozenset[str]) -> None:
        for n in [e, *own_nodes(e)] if not isinstance(e, ast.stmt) else own_nodes(e):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.args:
                if n.func.attr in ADDERS:
                    self.steps.append(Step(n.func.value, n.args[-1], n, n.func.attr, False, guard))
            elif isinstance(n, ast.NamedExpr):
                self.steps.append(Step(n.target, n.value, n, "=", False, guard))
            elif isinstance(n, ast.comprehension):
                self._iteration(n.target, n.iter, n, guard)

    def _iteration(
        self, target: ast.AST, it: ast.expr, node: ast.AST, guard: frozenset[str]
    ) -> None:
        """``for i, x in enumerate(xs)``: ``i`` is a count and ``x`` an element of ``xs``;
        ``for a, b in zip(xs, ys)`` pairs each with its sequence; ``k, v in d.items()``."""
        if isinstance(it, ast.Call) and isinstance(target, ast.Tuple):
            name = tail(it.func)
            if name == "enumerate" and it.args and len(target.elts) == 2:
                self._pairs(target.elts[1], _element(it.args[0]), node, "for", guard)
                return
            if name == "zip" and len(it.args) == len(target.elts):
                for t, seq in zip(target.elts, it.args):
                    self._pairs(t, _element(seq), node, "for", guard)
                return
            if name == "items" and isinstance(it.func, ast.Attribute) and len(target.elts) == 2:
                self._pairs(target.elts[1], _element(it.func.value), node, "for", guard)
                return
        self._pairs(target, _element(it), node, "for", guard)

    def _pairs(
        self, target: ast.AST, value: ast.AST, node: ast.AST, how: str, guard: frozenset[str]
    ) -> None:
        """Split ``a, b = x, y`` element by element where the shapes match; each element
        of ``a, b = f(...)`` gets the whole value, marked ``split``."""
        if isinstance(target, (ast.Tuple, ast.List)):
            if (
                isinstance(value, (ast.Tuple, ast.List))
                and len(target.elts) == len(value.elts)
                and not any(isinstance(v, ast.Starred) for v in [*target.elts, *value.elts])
            ):
                for t, v in zip(target.elts, value.elts):
                    self._pairs(t, v, node, how, guard)
                return
            flat = not any(isinstance(t, ast.Starred) for t in target.elts)
            for i, t in enumerate(target.elts):
                t = t.value if isinstance(t, ast.Starred) else t
                if isinstance(t, (ast.Tuple, ast.List)):
                    self._pairs(t, value, node, how, guard)
                else:
                    index = i if flat else None
                    self.steps.append(Step(t, value, node, how, True, guard, index))
            return
        self.steps.append(Step(target, value, node, how, False, guard))

    # -- questions -----------------------------------------------------------------------
    def aliases(self, name: str) -> set[str]:
        """``name`` and the plain names assigned from it (``c = ctx``), transitively."""
        found = {name}
        changed = True
        while changed:
            changed = False
            for s in self.steps:
                if (
                    s.how == "="
                    and isinstance(s.value, ast.Name)
                    and s.value.id in found
                    and isinstance(s.target, ast.Name)
                    and s.target.id not in found
                ):
                    found.add(s.target.id)
                    changed = True
        return found

    def spread(
        self,
        seed: dict[str, Reason],
        carries: Callable[[Step, dict[str, Reason]], bool],
        into: Callable[[Step], bool] = lambda s: True,
    ) -> dict[str, Reason]:
        """Names reached from ``seed`` (name -> why) through steps whose value ``carries``
        a reached name, to a fixpoint; ``into`` filters the steps that may add their
        target. Each added name's why is the step that added it."""
        reached: dict[str, Reason] = dict(seed)
        changed = True
        while changed:
            changed = False
            for s in self.steps:
                name = s.name
                if name is None or name in reached or not into(s):
                    continue
                if carries(s, reached):
                    reached[name] = s
                    changed = True
        return reached


#: why a name is believed to hold something: a sentence, or the step that put it there
Reason = str | Step


def said(reason: Reason) -> str:
    return reason if isinstance(reason, str) else reason.said()


def _element(seq: ast.expr) -> ast.AST:
    """An element of ``seq``, as an expression (``seq[0]``)."""
    return ast.copy_location(ast.Subscript(seq, ast.Constant(0), ast.Load()), seq)


def tensor_test(test: ast.AST) -> tuple[bool, ast.AST] | None:
    """(True, x) for ``is_tensor(x)`` / ``isinstance(x, ...Tensor)``, (False, x) for their
    negation and for ``isinstance(x, int)`` (or any plain type: a number, a string...
    is no tensor), None for any other test."""
    negated = False
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        negated, test = not negated, test.operand
    if not isinstance(test, ast.Call) or not test.args:
        return None
    last = tail(test.func)
    if last == "is_tensor" or (
        last == "isinstance" and len(test.args) == 2 and "Tensor" in ast.unparse(test.args[1])
    ):
        return not negated, test.args[0]
    if last == "isinstance" and len(test.args) == 2:
        kinds = test.args[1].elts if isinstance(test.args[1], ast.Tuple) else [test.args[1]]
        if all(plain_annotation(k) for k in kinds):
            return negated, test.args[0]
    return None
