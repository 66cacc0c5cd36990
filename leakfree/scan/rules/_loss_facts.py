"""Per-file facts LF003 reads once: module globals, ``LossLog``-bound names, the ``self``
containers a class feeds to backward, and the parameters a helper stores unchanged.

They are cached on the :class:`~leakfree.scan._model.Project` of the run (never in module
globals, which would keep every syntax tree of a large scan alive)."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass, field

from leakfree.scan._model import Project, Source
from leakfree.scan._syntax import FunctionNode, root, tail, walk
from leakfree.scan.rules._loss_kinds import BACKWARD_CALLS, LOSSLOG_TYPES, Kind


@dataclass
class Env:
    """What one function knows: kinds and container roots of its local names."""

    kinds: dict[str, Kind | None] = field(default_factory=dict)
    #: local name -> the long-lived expression it aliases (``hist = self.history``)
    aliases: dict[str, ast.expr] = field(default_factory=dict)
    #: locals created as fresh containers (``[]``, ``{}``, ``defaultdict(list)``)
    fresh: set[str] = field(default_factory=set)


@dataclass
class Module:
    """Per-file facts the rule needs: globals, LossLog-typed names, backward-fed attributes."""

    globals: set[str]
    losslog_names: set[str]
    backward_attrs: dict[int, set[str]]  # id(class node) -> self attributes read near backward
    #: functions and classes the module defines: a name bound to one holds no graph
    #: (unsloth's ``RL_FUNCTIONS[k].append(sft_trainer_compute_loss)``, a function)
    defined: frozenset[str] = frozenset()
    #: names ``import`` binds to modules: ``ltorch.nll_loss`` is a function, not a loss
    modules: frozenset[str] = frozenset()


def module_facts(tree: ast.Module, text: str) -> Module:
    globals_: set[str] = set()
    for stmt in tree.body:
        targets: list[ast.expr] = []
        if isinstance(stmt, ast.Assign):
            targets = stmt.targets
        elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
            targets = [stmt.target]
        for t in targets:
            for n in walk(t):
                if isinstance(n, ast.Name):
                    globals_.add(n.id)
    losslog: set[str] = set()
    if any(name in text for name in LOSSLOG_TYPES):
        for node in walk(tree):
            if isinstance(node, ast.Call) and tail(node.func) in LOSSLOG_TYPES:
                losslog |= assigned_names_of_call(tree, node)
    defined = frozenset(
        n.name
        for n in tree.body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    )
    modules = frozenset(
        (a.asname or a.name).split(".")[0]
        for n in tree.body
        if isinstance(n, ast.Import)
        for a in n.names
    )
    return Module(globals_ - defined, losslog, {}, defined, modules)


def class_backward_attrs(module: Module, cls: ast.ClassDef) -> set[str]:
    """Computed on demand: only a would-be finding on ``self`` asks."""
    attrs = module.backward_attrs.get(id(cls))
    if attrs is None:
        attrs = set()
        for fn in walk(cls):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                attrs |= backward_attrs(fn)
        module.backward_attrs[id(cls)] = attrs
    return attrs


def assigned_names_of_call(tree: ast.Module, call: ast.Call) -> set[str]:
    """Names and attribute names a ``LossLog(...)`` call is bound to (computed lazily)."""
    out: set[str] = set()
    for node in walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is call:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {tail(t) for t in targets if tail(t)}
        elif isinstance(node, ast.keyword) and node.value is call and node.arg:
            out.add(node.arg)
    return out


def self_attrs_and_names(nodes: Iterable[ast.AST]) -> tuple[set[str], set[str]]:
    attrs: set[str] = set()
    names: set[str] = set()
    for top in nodes:
        for n in walk(top):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
                if n.value.id == "self":
                    attrs.add(n.attr)
            elif isinstance(n, ast.Name) and n.id != "self":
                names.add(n.id)
    return attrs, names


def backward_attrs(fn: FunctionNode) -> set[str]:
    """``self`` attributes whose values reach a backward call in ``fn``:
    ``self.fwd_cache[i]`` in ``stage_backward(...)``, or ``loss = self._losses[i]``
    followed by ``loss.backward()`` (local names are followed through assignments)."""
    roots: list[ast.AST] = []
    for n in walk(fn):
        if not isinstance(n, ast.Call) or tail(n.func) not in BACKWARD_CALLS:
            continue
        if isinstance(n.func, ast.Attribute) and tail(n.func) == "backward":
            roots.append(n.func.value)  # x.backward(): x, not self.accelerator
        if tail(n.func) == "grad" and not (
            isinstance(n.func, ast.Attribute) and tail(n.func.value) == "autograd"
        ):
            continue
        roots.extend([*n.args, *(k.value for k in n.keywords)])
    if not roots:
        return set()
    attrs, names = self_attrs_and_names(roots)
    assigns: dict[str, list[ast.expr]] = {}
    for n in walk(fn):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                for leaf in walk(t):
                    if isinstance(leaf, ast.Name):
                        assigns.setdefault(leaf.id, []).append(n.value)
        elif isinstance(n, ast.For):
            for leaf in walk(n.target):
                if isinstance(leaf, ast.Name):
                    assigns.setdefault(leaf.id, []).append(n.iter)
    seen: set[str] = set()
    todo = list(names)
    while todo:
        local = todo.pop()
        if local in seen:
            continue
        seen.add(local)
        more_attrs, more_names = self_attrs_and_names(assigns.get(local, ()))
        attrs |= more_attrs
        todo.extend(more_names - seen)
    return attrs


def stored_params(
    project: Project, source: Source, func: FunctionNode
) -> dict[str, tuple[ast.expr, str]]:
    """Parameters ``func`` stores unchanged into a long-lived container or a container
    parameter: name -> (the container expression, the container's root parameter or "")."""
    return project.memo("stored", source, func, lambda: _stored(project, source, func))


def _stored(
    project: Project, source: Source, func: FunctionNode
) -> dict[str, tuple[ast.expr, str]]:
    out: dict[str, tuple[ast.expr, str]] = {}
    args = func.args
    params = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    self_name = params[0] if params and params[0] in {"self", "cls"} else None
    module_globals = module_facts_cached(project, source).globals
    reassigned = {
        n.id for n in walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    for node in walk(func):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in {"append", "extend", "insert"}
            and node.args
        ):
            continue
        value = node.args[-1]
        if not isinstance(value, ast.Name) or value.id not in params or value.id in reassigned:
            continue
        if value.id == self_name:
            continue
        base, path = root(node.func.value)
        if base is None:
            continue
        if base.id == self_name and path:
            out[value.id] = (node.func.value, "")
        elif base.id in params and base.id != self_name:
            out[value.id] = (node.func.value, base.id)
        elif base.id in module_globals and base.id not in reassigned:
            out[value.id] = (node.func.value, "")
    return out


def module_facts_cached(project: Project, source: Source) -> Module:
    """:func:`module_facts` of ``source``, once per run."""
    return project.memo(
        "facts", source, source.tree, lambda: module_facts(source.tree, source.text)
    )
