"""LF005's reading of the code around a receive buffer: what makes it an autograd leaf
(``requires_grad_()``, a factory's ``requires_grad=True``, a helper that sets it), and
whether its ``.grad`` is read later (in its function, a method of its class through a
``self.`` container, or a helper it is handed, also through ``partial`` or a local alias).
Helpers are found by name in the scanned tree."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from leakfree.scan._flow import Flow
from leakfree.scan._model import Project, Source
from leakfree.scan._syntax import own_nodes, positional, tail, walk

_FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef

FACTORIES = frozenset(
    {
        "empty",
        "zeros",
        "ones",
        "full",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "empty_strided",
        "new_empty",
        "new_zeros",
        "new_ones",
        "new_full",
    }
)
_PUTS = frozenset({"append", "insert", "extend", "appendleft"})
#: methods whose result is the same data (an alias or a copy of the buffer)
ALIASES = frozenset(
    {
        "detach",
        "view",
        "view_as",
        "reshape",
        "to",
        "contiguous",
        "clone",
        "float",
        "half",
        "bfloat16",
    }
)


def creates_leaf(call: ast.Call) -> bool:
    """``torch.empty(..., requires_grad=True)`` (any factory, a non-False value) or
    ``t.requires_grad_()``."""
    name = tail(call.func)
    requires = kw(call, "requires_grad")
    if name in FACTORIES:
        return requires is not None and true(requires)
    return name == "requires_grad_" and true(call.args[0] if call.args else requires)


def made_leaf(node: ast.AST, names: set[str]) -> str | None:
    """The name ``node`` makes an autograd leaf (``n.requires_grad_()``, ``n.detach()
    .requires_grad_()``, ``n.requires_grad = True``) if it is one of ``names``."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "requires_grad_"
        and true(node.args[0] if node.args else kw(node, "requires_grad"))
    ):
        base = base_name(node.func.value)
        return base if base in names else None
    if isinstance(node, ast.Assign) and (
        isinstance(node.value, ast.Constant) and node.value.value is True
    ):
        for t in node.targets:
            if (
                isinstance(t, ast.Attribute)
                and t.attr == "requires_grad"
                and isinstance(t.value, ast.Name)
                and t.value.id in names
            ):
                return t.value.id
    return None


def kw(call: ast.Call, name: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


class Helpers:
    """What the scanned tree's functions do with a received tensor: whether a leaf's
    ``.grad`` is read (in its function, its class or a helper it is passed to), and
    whether a helper makes its parameter a leaf."""

    def __init__(self, source: Source, project: Project) -> None:
        self.source = source
        self.project = project
        self._helper_cache: dict[tuple[str, int, bool], bool] = {}
        self._leaf_cache: dict[tuple[str, int, bool], bool] = {}
        self._receive_cache: dict[str, bool] = {}

    def _param_names(
        self, name: str, index: int, attribute_call: bool
    ) -> Iterator[tuple[list[ast.AST], set[str]]]:
        """For each function ``name`` in the tree: its own nodes, and the names its
        parameter at call position ``index`` reaches (itself, loop variables over it)."""
        for _src, fn in self.project.helpers(name):
            params = positional(fn)
            if params and params[0] in ("self", "cls"):
                if not attribute_call:  # a bare call never reaches a method
                    continue
                params = params[1:]
            if index >= len(params):
                continue
            names = {params[index]}
            self._spread(fn, names, set())
            yield list(own_nodes(fn)), names

    def receive_makes_leaf(self, name: str) -> bool:
        """Whether a receive function ``name``, or a function it calls that is defined in
        its own file, creates a tensor with ``requires_grad=True`` or calls
        ``requires_grad_()`` (nested functions included)."""
        found = self._receive_cache.get(name)
        if found is None:
            found = False
            for src, fn in self.project.helpers(name):
                callees = set()
                for n in walk(fn):
                    if isinstance(n, ast.Call):
                        if creates_leaf(n):
                            found = True
                            break
                        callees.add(tail(n.func))
                if found:
                    break
                # one call deeper, only into the same file (a common name such as
                # ``get`` would otherwise match unrelated functions across the tree)
                local = self.project.defs(src)
                found = any(
                    creates_leaf(n)
                    for c in callees
                    for callee in local.get(c, ())
                    if callee is not fn
                    for n in walk(callee)
                    if isinstance(n, ast.Call)
                )
                if found:
                    break
            self._receive_cache[name] = found
        return found

    def makes_leaf(self, name: str, index: int, attribute_call: bool) -> bool:
        """Whether a function ``name`` makes its argument at ``index`` an autograd leaf."""
        key = (name, index, attribute_call)
        found = self._leaf_cache.get(key)
        if found is None:
            found = any(
                made_leaf(n, names) is not None
                for nodes, names in self._param_names(name, index, attribute_call)
                for n in nodes
            )
            self._leaf_cache[key] = found
        return found

    def read(self, fn: _FunctionNode, cls: ast.ClassDef | None, aliases: set[str]) -> bool:
        names = set(aliases)
        containers: set[str] = set()
        nodes = list(own_nodes(fn))
        self._spread(fn, names, containers)
        if self._reads(nodes, names, containers):
            return True
        shared = {c for c in containers if c.startswith("self.")}
        if cls is not None and shared:
            for method in cls.body:
                if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) and method is not fn:
                    m_nodes = list(own_nodes(method))
                    m_names: set[str] = set()
                    m_containers = set(shared)
                    self._spread(method, m_names, m_containers)
                    if self._reads(m_nodes, m_names, m_containers):
                        return True
        return False

    @staticmethod
    def _spread(fn: ast.AST, names: set[str], containers: set[str]) -> None:
        """Follow the leaf through ``fn``'s flow into containers (``inputs.append(x)``,
        ``d[k] = x``) and back out (``x = inputs.pop(0)``, ``for t in inputs``), to a fixed
        point (two passes)."""
        steps = Flow(fn).steps
        for _ in range(2):
            for step in steps:
                target, value = step.target, step.value
                if step.how in _PUTS or (step.how == "=" and isinstance(target, ast.Subscript)):
                    if _mentions(value, names):
                        base = target.value if isinstance(target, ast.Subscript) else target
                        containers.add(ast.unparse(base))
                elif (
                    step.how in ("=", "for")
                    and isinstance(target, ast.Name)
                    and (
                        _drawn(value, containers)
                        or (isinstance(value, ast.expr) and base_name(value) in names)
                        or (step.how == "for" and _mentions(value, names))
                    )
                ):
                    names.add(target.id)

    def _reads(self, nodes: list[ast.AST], names: set[str], containers: set[str]) -> bool:
        for node in nodes:
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "grad"
                and isinstance(node.ctx, ast.Load)
            ):
                v = node.value
                if isinstance(v, ast.Name) and v.id in names:
                    return True
                if _drawn(v, containers):
                    return True
            if isinstance(node, ast.Call):
                method = isinstance(node.func, ast.Attribute)
                callees = _callees(node.func, nodes)
                for i, arg in enumerate(node.args):
                    if (_mentions(arg, names) or _drawn(arg, containers)) and any(
                        self._helper_reads(name, i + bound, method) for name, bound in callees
                    ):
                        return True
        return False

    def _helper_reads(self, name: str, index: int, attribute_call: bool) -> bool:
        """Whether a function ``name`` reads ``.grad`` of its argument at ``index``."""
        key = (name, index, attribute_call)
        found = self._helper_cache.get(key)
        if found is None:
            found = any(
                isinstance(n, ast.Attribute)
                and n.attr == "grad"
                and isinstance(n.ctx, ast.Load)
                and isinstance(n.value, ast.Name)
                and n.value.id in names
                for nodes, names in self._param_names(name, index, attribute_call)
                for n in nodes
            )
            self._helper_cache[key] = found
        return found


def _callees(func: ast.expr, nodes: list[ast.AST]) -> list[tuple[str, int]]:
    """The function names a call may reach, each with how many leading positional
    parameters are already bound: its own name, and for a local variable the functions
    assigned to it (``backward_func = backward_step`` or ``partial(backward_step, ...)``,
    as Megatron-LM's schedules do)."""
    name = tail(func)
    out = [(name, 0)]
    if not isinstance(func, ast.Name):
        return out
    for node in nodes:
        if not (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == name
        ):
            continue
        value = node.value
        if isinstance(value, ast.Name):
            out.append((value.id, 0))
        elif isinstance(value, ast.Call) and tail(value.func) == "partial" and value.args:
            out.append((tail(value.args[0]), len(value.args) - 1))
    return out


def _mentions(expr: ast.AST, names: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for n in walk(expr))


def _drawn(expr: ast.AST, containers: set[str]) -> bool:
    """``c.pop(...)``, ``c.popleft()``, ``c[i]`` or ``c`` itself for a container ``c``."""
    if not containers:
        return False
    if isinstance(expr, (ast.Name, ast.Attribute)):  # iterated or passed on whole
        return ast.unparse(expr) in containers
    if isinstance(expr, ast.Subscript):
        return ast.unparse(expr.value) in containers
    if (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Attribute)
        and expr.func.attr in ("pop", "popleft", "get")
    ):
        return ast.unparse(expr.func.value) in containers
    return False


def true(expr: ast.expr | None) -> bool:
    return expr is None or not (isinstance(expr, ast.Constant) and expr.value in (False, 0))


def base_name(expr: ast.expr) -> str | None:
    """``buf.detach().view(...)`` -> ``buf``: the name an alias chain starts from."""
    while True:
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
            if expr.func.attr not in ALIASES and expr.func.attr != "requires_grad_":
                return None
            expr = expr.func.value
        elif isinstance(expr, ast.Name):
            return expr.id
        else:
            return None
