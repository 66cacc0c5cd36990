"""LF001 and LF002's question about a Function's code: what does it put on ctx, where?

A :class:`Store` is one value put into a ctx attribute, with the function whose code made
it (forward, setup_context, backward, or a helper of the scanned tree they hand ctx to,
three calls deep) and the *part* of the attribute it fills: the whole attribute (``ctx.a =
v``, ``setattr(ctx, "a", v)``), a key (``ctx.side["bw"] = v``), an item (``ctx.a[i] = v``,
``ctx.a.append(v)``), or a field of the object the attribute holds (``ctx.req.tensor =
v``, or through a name bound to it: ``req = ctx.req; req.tensor = v``; in forward, the
object kept is also the name it was kept from: ``ctx.req = req; req.tensor = v``).

Two Functions of one file that each keep, under the same attribute, a forward parameter of
the same name (torchrec's ``ctx.myreq = myreq`` in a ``*_Req`` / ``*_Wait`` pair,
Thunder's ``ctx.side_channel = side_channel``) share that object: :func:`partners`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass

from leakfree.scan._flow import Flow
from leakfree.scan._model import Project, Source
from leakfree.scan._syntax import (
    FunctionClass,
    FunctionNode,
    attr_of,
    is_static,
    own_nodes,
    parameters,
    positional,
    words,
)
from leakfree.scan.rules._ctx_releases import Part

#: calls that add their (last) argument to the container they are called on
ADDERS = words("append extend add insert appendleft update setdefault")
FORWARD, BACKWARD = "forward", "backward"
_DEPTH = 3


@dataclass(frozen=True)
class Store:
    """One value put on ctx (see the module's docstring)."""

    attr: str
    value: ast.AST
    node: ast.AST
    fn: FunctionNode  #: the function whose code stores it
    half: str  #: :data:`FORWARD` (setup_context too) or :data:`BACKWARD`
    part: Part | None = None  #: None: the whole attribute
    #: names an enclosing ``if torch.is_tensor(x)`` proves hold no tensor here
    not_tensors: frozenset[str] = frozenset()
    #: the position in ``a, ctx.b = f(x)`` (the value is the whole call), else None
    index: int | None = None
    #: the names ``fn`` calls its ctx by
    ctx: frozenset[str] = frozenset()
    #: a field given through a name bound to the object (``req.tensor = t``), not ctx
    through_name: bool = False


def ctx_param(fn: FunctionNode) -> str | None:
    """The ctx parameter of a Function's method: the first, the second of a classmethod
    (gsplat's ``def backward(cls, ctx, ...)``)."""
    params = positional(fn)
    classmethod_ = any(ast.unparse(d) == "classmethod" for d in fn.decorator_list)
    if classmethod_:
        return params[1] if len(params) > 1 else None
    if params and params[0] in ("self", "cls") and not is_static(fn):
        return None
    return params[0] if params else None


def stores(
    fn: FunctionNode,
    param: str,
    half: str,
    project: Project,
    source: Source,
    depth: int = 0,
    *,
    follow: bool = True,
    flow: Flow | None = None,
) -> Iterator[Store]:
    """Every value ``fn`` (whose ctx is ``param``) and, with ``follow``, the helpers it
    hands ctx to put on ctx, in source order within each function (``flow``: ``fn``'s,
    when made already)."""
    flow = flow or Flow(fn)
    ctx = flow.aliases(param)
    held = _held(flow, ctx)
    for step in flow.steps:
        target = step.target
        part: Part | None = None
        if isinstance(target, ast.Subscript):
            attr = attr_of(target.value, ctx)
            part = _key(target.slice)
        elif step.how in ADDERS:
            attr = attr_of(target, ctx)
            part = ("item", None)
        else:
            attr = attr_of(target, ctx)
        through_name = False
        if attr is None and isinstance(target, ast.Attribute):
            owner = _owner(target.value, ctx, held)
            if owner is not None:
                attr, part = owner, ("field", target.attr)
                through_name = attr_of(target.value, ctx) is None
        if attr is not None and (step.how in ADDERS or step.how in ("=", "+=")):
            yield Store(
                attr, step.value, step.node, fn, half, part, step.not_tensors, step.index,
                frozenset(ctx), through_name,
            )  # fmt: skip
    for n in own_nodes(fn):
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)
            and n.func.id == "setattr"
            and len(n.args) == 3
            and isinstance(n.args[0], ast.Name)
            and n.args[0].id in ctx
            and isinstance(n.args[1], ast.Constant)
            and isinstance(n.args[1].value, str)
        ):
            yield Store(n.args[1].value, n.args[2], n, fn, half, ctx=frozenset(ctx))
    if follow and depth < _DEPTH:
        for helper, inner in helpers(fn, ctx, project, source):
            yield from stores(helper, inner, half, project, source, depth + 1)


def helpers(
    fn: FunctionNode, ctx: set[str], project: Project, source: Source
) -> Iterator[tuple[FunctionNode, str]]:
    """(helper, its parameter) for each call of ``fn`` handing ctx to a plain-named
    function: the one this file defines, else every one of that name in the tree."""
    for n in own_nodes(fn):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)):
            continue
        at = [i for i, a in enumerate(n.args) if isinstance(a, ast.Name) and a.id in ctx]
        if not at:
            continue
        local = project.defs(source).get(n.func.id, [])
        for helper in local or [h for _, h in project.helpers(n.func.id)]:
            params = parameters(helper)
            if helper is not fn and at[0] < len(params):
                yield helper, params[at[0]].arg


def _held(flow: Flow, ctx: set[str]) -> dict[str, str]:
    """Local name -> the ctx attribute whose object it is: read from it (``req =
    ctx.req``) or kept in it (``ctx.req = req``)."""
    out: dict[str, str] = {}
    for s in flow.steps:
        if s.how != "=" or s.split:
            continue
        attr = attr_of(s.value, ctx)
        if attr is not None and isinstance(s.target, ast.Name):
            out[s.target.id] = attr
        kept = attr_of(s.target, ctx)
        if kept is not None and isinstance(s.value, ast.Name) and s.value.id not in ctx:
            out.setdefault(s.value.id, kept)
    return out


def _owner(e: ast.AST, ctx: set[str], held: dict[str, str]) -> str | None:
    attr = attr_of(e, ctx)
    if attr is None and isinstance(e, ast.Name):
        attr = held.get(e.id)
    return attr


def _key(key: ast.AST) -> Part:
    if isinstance(key, ast.Constant) and isinstance(key.value, (str, int)):
        return ("key", str(key.value))
    return ("item", None)


def kept_parameter(fn: FunctionNode, ctx: set[str], attr: str) -> str | None:
    """The forward parameter ``fn`` keeps whole in ``ctx.attr`` (``ctx.myreq = myreq``)."""
    params = {p.arg for p in parameters(fn)}
    for n in own_nodes(fn):
        if (
            isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Name)
            and n.value.id in params
            and any(attr_of(t, ctx) == attr for t in n.targets)
        ):
            return n.value.id
    return None


def partners(
    fc: FunctionClass, attr: str, param: str, classes: list[FunctionClass]
) -> list[FunctionClass]:
    """The other Functions of the file that keep a parameter named ``param`` in
    ``ctx.attr`` too: they hold the same object."""
    out = []
    for other in classes:
        if other is fc:
            continue
        entry = other.method("setup_context") or other.method("forward")
        if entry is None:
            continue
        name = ctx_param(entry)
        if name is None:
            continue
        if kept_parameter(entry, Flow(entry).aliases(name), attr) == param:
            out.append(other)
    return out
