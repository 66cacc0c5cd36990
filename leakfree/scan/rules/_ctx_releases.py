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

#: part of what a ctx attribute holds: ("key", "fw") of a dict, ("field", "tensor") of an
#: object, ("item", None) of a list or a dict filled with computed keys
Part = tuple[str, str | None]


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
        self.part_memo: dict[tuple[int, str], dict[str, set[Part]]] = {}
        self.method_memo: dict[str, set[Part]] = {}

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
            if f.attr in ("pop", "popleft") and not n.args and attr_of(recv, ctx) is not None:
                # ``inputs = ctx.inputs.pop()``: the one thing kept is taken back
                out.add(attr_of(recv, ctx))  # type: ignore[arg-type]
                return out
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
        # ctx.a handed on is followed only into a plain-named helper of this project
        # (``_drop(ctx.buffers)``), not into ``torch.matmul(g, ctx.w)`` or ``x.mul(ctx.s)``
        attrs_too = isinstance(f, ast.Name) and not self.names.get(f.id, "").startswith("torch")
        passed = _passed(n, ctx, attrs_too)
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

    def parts(self, fn: FunctionNode, param: str) -> dict[str, set[Part]]:
        """Attribute -> the parts of what it holds that ``fn`` (with ctx ``param``)
        empties: a field set to ``None`` or an empty container or deleted
        (``ctx.req.tensor = None``, or through a name read from it: ``req = ctx.req;
        req.tensor = None``), or by a method of the object that does so to its ``self``
        (fairscale's ``ctx.portal.use_grad()``; same-named methods of the scanned tree,
        any that clears counts), a key popped or deleted (``ctx.side.pop("bw")``), every
        item (``.clear()``, ``.pop()`` / ``.popleft()`` of a list)."""
        key = (id(fn), "parts:" + param)
        if key in self.part_memo:
            return self.part_memo[key]
        flow = Flow(fn)
        ctx = flow.aliases(param)
        held: dict[str, str] = {}  # local name -> the attribute whose object it reads
        for st in flow.steps:
            attr = attr_of(st.value, ctx)
            if st.how == "=" and not st.split and isinstance(st.target, ast.Name) and attr:
                held[st.target.id] = attr

        def owner(e: ast.AST) -> str | None:
            """The ctx attribute whose object ``e`` is (``ctx.a`` or a name read from it)."""
            attr = attr_of(e, ctx)
            if attr is None and isinstance(e, ast.Name):
                attr = held.get(e.id)
            return attr

        out: dict[str, set[Part]] = {}
        for n in own_nodes(fn):
            for t in _emptied(n):
                if isinstance(t, ast.Attribute) and (a := owner(t.value)) is not None:
                    out.setdefault(a, set()).add(("field", t.attr))
                elif isinstance(t, ast.Subscript) and (a := owner(t.value)) is not None:
                    out.setdefault(a, set()).add(_keyed(t.slice))
            if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
                continue
            a = owner(n.func.value)
            if a is None:
                continue
            if n.func.attr == "pop" and n.args:
                out.setdefault(a, set()).add(_keyed(n.args[0]))
            elif n.func.attr in ("clear", "pop", "popleft", "popitem"):
                out.setdefault(a, set()).add(("item", None))
            else:
                out.setdefault(a, set()).update(self._method_clears(n.func.attr))
        self.part_memo[key] = out
        return out

    def _method_clears(self, name: str) -> set[Part]:
        """Fields the methods named ``name`` of the scanned tree empty on their ``self``."""
        found = self.method_memo.get(name)
        if found is None:
            found = set()
            for _, method in self.project.helpers(name):
                params = parameters(method)
                if not params or params[0].arg != "self":
                    continue
                for n in own_nodes(method):
                    for t in _emptied(n):
                        if (
                            isinstance(t, ast.Attribute)
                            and isinstance(t.value, ast.Name)
                            and t.value.id == "self"
                        ):
                            found.add(("field", t.attr))
            self.method_memo[name] = found
        return found


def _emptied(n: ast.AST) -> list[ast.AST]:
    """The targets ``n`` sets to ``None`` / an empty container, or deletes (``x.f = None``,
    ``del x[k]``, ``grad, self.grad = self.grad, None``)."""
    if isinstance(n, ast.Delete):
        return list(n.targets)
    if not isinstance(n, ast.Assign):
        return []
    if _is_empty(n.value):
        return [e for t in n.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
    out: list[ast.AST] = []
    if isinstance(n.value, ast.Tuple):
        for t in n.targets:
            if isinstance(t, ast.Tuple) and len(t.elts) == len(n.value.elts):
                out += [e for e, v in zip(t.elts, n.value.elts) if _is_empty(v)]
    return out


def _keyed(key: ast.AST) -> Part:
    if isinstance(key, ast.Constant) and isinstance(key.value, (str, int)):
        return ("key", str(key.value))
    return ("item", None)


def _passed(n: ast.Call, ctx: set[str], attrs_too: bool) -> list[tuple[int | str, str | None]]:
    """Which arguments of ``n`` are the ctx (``(position or keyword, None)``) or, with
    ``attrs_too``, a ctx attribute (``(position or keyword, attribute)``)."""
    passed: list[tuple[int | str, str | None]] = []
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
    return passed
