"""LF001's question about backward: which ctx attributes does it release?

``backward`` (or ``vjp``) releases an attribute when it sets it to ``None`` or another
constant or empty container, deletes it, clears it, clears the whole ctx, or passes ctx (or
the attribute) to a function of the scanned tree that does one of these to its parameter,
followed by name through :meth:`Project.helpers <leakfree.scan._model.Project.helpers>`,
four calls deep. A release on any branch counts: control flow is not judged.
"""

from __future__ import annotations

import ast

from leakfree.scan._flow import Flow
from leakfree.scan._model import Project
from leakfree.scan._syntax import FunctionNode, attr_of, own_nodes, parameters

_MAX_DEPTH = 4


ALL = "*"  # the whole ctx is released


def _is_empty(v: ast.AST) -> bool:
    if isinstance(v, ast.Constant):
        return True
    if isinstance(v, (ast.List, ast.Tuple, ast.Set)):
        return not v.elts
    if isinstance(v, ast.Dict):
        return not v.keys
    return (
        isinstance(v, ast.Call)
        and isinstance(v.func, ast.Name)
        and v.func.id in ("list", "dict", "tuple", "set")
        and not v.args
        and not v.keywords
    )


class Releases:
    """Which ctx attributes a function releases, following calls into the scanned tree."""

    def __init__(self, project: Project, names: dict[str, str]) -> None:
        self.project = project
        self.names = names  # the scanned file's imports
        self.memo: dict[tuple[int, str], frozenset[str]] = {}
        self.clears: dict[tuple[int, str], bool] = {}

    def of(self, fn: FunctionNode, param: str, depth: int = 0) -> frozenset[str]:
        """Attributes of ``param`` that ``fn`` releases (``"*"`` for all of them)."""
        key = (id(fn), param)
        if key in self.memo:
            return self.memo[key]
        self.memo[key] = frozenset()  # recursion guard
        ctx = Flow(fn).aliases(param)
        out: set[str] = set()
        for n in own_nodes(fn):
            if isinstance(n, ast.Assign) and _is_empty(n.value):
                for t in n.targets:
                    for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                        a = attr_of(e, ctx)
                        if a is not None:
                            out.add(a)
            elif isinstance(n, ast.Assign) and isinstance(n.value, ast.Tuple):
                for t in n.targets:  # ctx.a, ctx.b = None, None
                    if isinstance(t, ast.Tuple) and len(t.elts) == len(n.value.elts):
                        for e, v in zip(t.elts, n.value.elts):
                            a = attr_of(e, ctx)
                            if a is not None and _is_empty(v):
                                out.add(a)
            elif isinstance(n, ast.Delete):
                for t in n.targets:
                    a = attr_of(t, ctx)
                    if a is not None:
                        out.add(a)
            elif isinstance(n, ast.Call):
                out |= self._call(n, ctx, depth)
        result = frozenset(out)
        self.memo[key] = result
        return result

    def _call(self, n: ast.Call, ctx: set[str], depth: int) -> set[str]:
        f = n.func
        out: set[str] = set()
        if isinstance(f, ast.Name) and f.id in ("delattr", "setattr") and n.args:
            if isinstance(n.args[0], ast.Name) and n.args[0].id in ctx and len(n.args) >= 2:
                key = n.args[1]
                if f.id == "setattr" and (len(n.args) < 3 or not _is_empty(n.args[2])):
                    return out
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    out.add(key.value)
                else:
                    out.add(ALL)  # a loop over names: take it as releasing everything
            return out
        if isinstance(f, ast.Attribute):
            recv = f.value
            if f.attr in ("clear", "pop", "popitem"):
                held = attr_of(recv, ctx)
                if held == "__dict__" or (
                    isinstance(recv, ast.Call)
                    and isinstance(recv.func, ast.Name)
                    and recv.func.id == "vars"
                    and recv.args
                    and isinstance(recv.args[0], ast.Name)
                    and recv.args[0].id in ctx
                ):
                    if f.attr == "clear":
                        out.add(ALL)
                    elif n.args and isinstance(n.args[0], ast.Constant):
                        out.add(str(n.args[0].value))
                elif held is not None and f.attr == "clear":
                    out.add(held)
                return out
        if depth >= _MAX_DEPTH:
            return out
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        if name is None:
            return out
        # which arguments are the ctx, or a ctx attribute?
        passed: list[tuple[int | str, str | None]] = []
        # ctx.a handed on is followed only into a plain-named helper of this project
        # (``_drop(ctx.buffers)``), not into ``torch.matmul(g, ctx.w)`` or ``x.mul(ctx.s)``
        attrs_too = isinstance(f, ast.Name) and not self.names.get(f.id, "").startswith("torch")
        for i, arg in enumerate(n.args):
            if isinstance(arg, ast.Name) and arg.id in ctx:
                passed.append((i, None))
            elif attrs_too and (attr := attr_of(arg, ctx)) is not None:
                passed.append((i, attr))
        for k in n.keywords:
            if k.arg is None:
                continue
            if isinstance(k.value, ast.Name) and k.value.id in ctx:
                passed.append((k.arg, None))
            elif attrs_too and (attr := attr_of(k.value, ctx)) is not None:
                passed.append((k.arg, attr))
        if not passed:
            return out
        for _src, helper in self.project.helpers(name):
            params = parameters(helper)
            shift = (
                1
                if isinstance(f, ast.Attribute) and params and params[0].arg in ("self", "cls")
                else 0
            )
            for where, attr in passed:
                if isinstance(where, int):
                    if where + shift >= len(helper.args.posonlyargs) + len(helper.args.args):
                        continue
                    pname = params[where + shift].arg
                elif any(p.arg == where for p in params):
                    pname = where
                else:
                    continue
                if attr is None:
                    out |= self.of(helper, pname, depth + 1)
                elif self._clears(helper, pname):
                    out.add(attr)
        return out

    def _clears(self, fn: FunctionNode, param: str) -> bool:
        """Does ``fn`` empty the container it receives as ``param``?"""
        key = (id(fn), param)
        if key not in self.clears:
            names = Flow(fn).aliases(param)
            self.clears[key] = any(
                (
                    isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Attribute)
                    and n.func.attr == "clear"
                    and isinstance(n.func.value, ast.Name)
                    and n.func.value.id in names
                )
                or (
                    isinstance(n, ast.Delete)
                    and any(
                        isinstance(t, ast.Subscript)
                        and isinstance(t.value, ast.Name)
                        and t.value.id in names
                        and isinstance(t.slice, ast.Slice)
                        for t in n.targets
                    )
                )
                for n in own_nodes(fn)
            )
        return self.clears[key]
