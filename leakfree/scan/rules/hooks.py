"""LF004: a saved-tensor pack hook that parks the tensor in a long-lived table and hands
autograd a key into it.

The shape (TRL's and torchtune's ``OffloadActivations``)::

    class Offload(saved_tensors_hooks):
        def __init__(self):
            self.tracker = {}
            def pack(t):
                self.counter += 1
                self.tracker[self.counter] = t.to("cpu")   # <- LF004
                return self.counter
            ...
            super().__init__(pack, unpack)

Autograd stores whatever the pack hook returns in the graph, and frees it with the graph.
When that is an int, the graph owns nothing: the payload lives in the manager's table
until ``unpack`` pops it. A graph freed without backward (an evaluation forward, an
exception between forward and backward, a branch whose backward never runs) leaves its
entries behind for as long as the manager lives; a second backward through a
``retain_graph=True`` graph finds them gone. The fix is a pack hook that returns an object
owning the payload (``leakfree.offload.OffloadActivations`` returns such a handle): the
graph then frees the payload with itself.

What counts, decided from the code only:

- **A pack hook**: the first argument (or ``pack_hook=``) of a ``saved_tensors_hooks(...)``
  or ``_push_saved_tensors_default_hooks(...)`` call, of ``super().__init__(...)`` in a
  class deriving from ``saved_tensors_hooks``, or of ``<node>._raw_saved_*.register_hooks``.
  It is resolved to a function in the same file: a nested or module-level ``def`` of that
  name, a method (``self.pack``), a lambda, ``functools.partial(pack, ...)``, or the
  closure a factory call returns (``make_pack(...)`` whose body ends in ``return pack``);
  across files through the scanned tree's functions of that name.
- **A long-lived table**: a subscript store (``table[key] = t``), a ``table.update({key:
  t})`` / ``table.update(key=t)``, or an append to a list whose index the hook returns
  (``table.append(t.cpu()); return len(table) - 1``), whose container is reached from the
  instance (``self.x[...]``, ``self`` being the method's first parameter or the enclosing
  method's for a closure defined in ``__init__``), from a module global, or from a
  variable of an enclosing function or a parameter bound by ``partial`` (either lives as
  long as the hook). A local dict of the hook itself, or a container created as a
  ``WeakKeyDictionary`` / ``WeakValueDictionary`` in the file (the graph owns the handle
  key, and the entry goes with it: ``torch.autograd.graph.allow_mutation_on_saved_tensors``),
  is not one.
- **Stores the tensor**: the stored value mentions the hook's parameter or a name derived
  from it (``activation = activation.clone()``, ``cpu = torch.empty_like(a); cpu.copy_(a)``)
  other than through metadata (``.shape``, ``.dtype``, ``.device``, ``.stride()``,
  ``.numel()``, ``data_ptr()``, ``id()``, ``len()``, ``weakref.ref(t)``...).
- **Returns a key**: a ``return`` of the same expression as that store's key (or a tuple
  holding it beside nothing tensor-derived), or of the list's last index (``len(table) -
  1``) after an append, so a store that is not the one the key indexes is not reported. A
  hook returning the tensor itself or a handle object is silent, whatever else it records.

When the hook's return value is a call (``return self._pack(t)``, ``return
manager.offload(t)``) that receives the tensor, or a name bound to one (verl's ``tag =
self.offload_handler.tensor_push(t); return tag``), the called function is checked the
same way (two levels deep), by name in the scanned tree.

**What it can and cannot tell.** Clearing the table in ``unpack`` or ``__enter__`` does
not silence the rule: neither runs for a graph freed without backward. It does change
how long the payload stays, and the finding says which: a table the owning class clears
in ``__enter__`` / ``__exit__`` (TRL from 1.5, so 1.16) keeps such entries until the next
``with`` block; one cleared nowhere but in ``unpack`` (TRL 1.3) keeps them for the
manager's life. Whether a graph is ever freed without backward is a run-time fact the
scan cannot see; ``leakfree.testing.assert_no_leak`` around an evaluation step shows it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Sequence

from leakfree.scan._callables import Callables, Target
from leakfree.scan._flow import Flow, Reason, Step
from leakfree.scan._model import Project, ScanFinding, ScanRule, Source
from leakfree.scan._syntax import (
    Scope,
    Scopes,
    bound_names,
    children,
    declared,
    own_nodes,
    positional,
    root,
    tail,
    walk,
)
from leakfree.scan._tensors import META_ATTRS, META_BUILTINS, META_METHODS

__all__ = ["RULES"]

CODE = "LF004"
CONFIRM = "leakfree.testing.assert_no_leak"

_FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef

#: calls whose first argument is a pack hook
_REGISTER = frozenset({"saved_tensors_hooks", "_push_saved_tensors_default_hooks"})
#: what a tensor's metadata is read through, not its payload (``untyped_storage()`` only
#: ever leads to ``data_ptr()`` / ``nbytes()`` in key code; ``weakref.ref(t)`` keeps nothing)
_META_METHODS = META_METHODS | {"untyped_storage", "_typed_storage"}
_META_CALLS = META_BUILTINS | {"ref", "WeakMethod", "StorageWeakRef"}

MESSAGE = (
    "the pack hook stores the saved tensor in {table} and returns a key into it, so the "
    "table, not the graph, owns the payload: a graph freed without backward leaves it "
    "there {how_long}; return an object that owns the payload instead (as "
    "leakfree.offload.OffloadActivations does)"
)


# --- the hook function ----------------------------------------------------------------


def _registrations(source: Source, resolver: Callables) -> Iterator[Target]:
    """Every pack hook registered in ``source``."""
    for node in walk(source.tree):
        if not isinstance(node, ast.Call):
            continue
        chain = resolver.scopes.chain(node)
        pack: ast.expr | None = None
        func = node.func
        name = tail(func)
        if name in _REGISTER and node.args:
            pack = node.args[0]
        elif name == "__init__" and isinstance(func, ast.Attribute):
            pack = _super_init_pack(node, func, chain)
        elif (
            name == "register_hooks"
            and isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Attribute)
            and func.value.attr.startswith("_raw_saved_")
            and node.args
        ):
            pack = node.args[0]
        for kw in node.keywords:
            if kw.arg == "pack_hook":
                pack = kw.value
        if pack is not None:
            hook = resolver.resolve(pack, chain)
            if hook is not None:
                yield hook


def _super_init_pack(
    node: ast.Call, func: ast.Attribute, chain: tuple[Scope, ...]
) -> ast.expr | None:
    classes = [s for s in chain if isinstance(s, ast.ClassDef)]
    if not classes or not any(tail(b) == "saved_tensors_hooks" for b in classes[-1].bases):
        return None
    base = func.value
    if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
        return node.args[0] if node.args else None
    if tail(base) == "saved_tensors_hooks":  # saved_tensors_hooks.__init__(self, p, u)
        return node.args[1] if len(node.args) > 1 else None
    return None


# --- what the hook does ---------------------------------------------------------------


def _carries(expr: ast.AST, tainted: Iterable[str]) -> bool:
    """Whether ``expr`` can hold (a copy of) a tainted tensor, not just its metadata."""
    if isinstance(expr, ast.Name):
        return expr.id in tainted
    if isinstance(expr, ast.Attribute):
        return expr.attr not in META_ATTRS and _carries(expr.value, tainted)
    if isinstance(expr, ast.Call):
        f = expr.func
        fname = tail(f)
        if fname in _META_CALLS or (isinstance(f, ast.Attribute) and fname in _META_METHODS):
            return False
        parts: list[ast.AST] = [*expr.args, *(k.value for k in expr.keywords)]
        if isinstance(f, ast.Attribute):
            parts.append(f.value)
        return any(_carries(p, tainted) for p in parts)
    if isinstance(expr, (ast.Compare, ast.Lambda)):
        return False  # a comparison is a bool; a lambda runs later
    return any(_carries(c, tainted) for c in children(expr))


def _taint(hook: Target) -> dict[str, Reason]:
    """The hook's parameter and the locals derived from it (``activation =
    activation.contiguous()``, ``cpu = torch.empty_like(a); cpu.copy_(a)``)."""
    flow = Flow(hook.fn)

    def carries(step: Step, reached: dict[str, Reason]) -> bool:
        return _carries(step.value, reached)

    # only plain names and display targets: ``self.table[k] = t`` is the store itself
    return flow.spread(
        {hook.params[0]: "the saved tensor"}, carries, lambda s: isinstance(s.target, ast.Name)
    )


def _table_symbol(hook: Target, table: ast.expr, module_names: set[str]) -> str | None:
    """The long-lived table's symbol (``Class.attr``, a global, ``func.var``), or None when
    ``table`` is local to the hook."""
    name, attrs = root(table)
    if name is None:
        return None
    fn = hook.fn
    local = set(positional(fn)) | bound_names(fn)
    if name.id in declared(fn, ast.Global):
        return ".".join([name.id, *attrs])
    own_chain = (*hook.chain, fn) if not isinstance(fn, ast.Lambda) else hook.chain
    label = fn.name if not isinstance(fn, ast.Lambda) else "<lambda>"
    if name.id in hook.bound:  # bound by partial: it lives as long as the hook
        return ".".join([label, name.id, *attrs])
    if name.id in local and name.id not in declared(fn, ast.Nonlocal):
        # the hook's own parameter: ``self`` of a method hook
        cls = Scopes.class_of_self(name.id, own_chain) if attrs else None
        return ".".join([cls.name, *attrs]) if cls is not None else None
    # a free variable: an enclosing function's (its ``self``, or a closure variable)
    for scope in reversed(hook.chain):
        if isinstance(scope, ast.ClassDef):
            continue
        if name.id in positional(scope) or name.id in bound_names(scope):
            cls = Scopes.class_of_self(name.id, own_chain) if attrs else None
            if cls is not None:
                return ".".join([cls.name, *attrs])
            outer = scope.name if not isinstance(scope, ast.Lambda) else "<lambda>"
            return ".".join([outer, name.id, *attrs])
    if name.id in module_names:
        return ".".join([name.id, *attrs])
    return None


_WEAK_TABLES = frozenset({"WeakKeyDictionary", "WeakValueDictionary", "WeakSet"})


def _weak_table(tree: ast.Module, table: ast.expr) -> bool:
    """Whether ``table``'s name is bound to a weak container anywhere in the file (the
    graph owns a handle key, and the entry goes with it: ``allow_mutation_on_saved_tensors``)."""
    name = tail(table)
    if not name:
        return False
    for node in walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call):
            if tail(node.value.func) not in _WEAK_TABLES:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(tail(t) == name for t in targets):
                return True
    return False


def _returns(fn: _FunctionNode | ast.Lambda) -> list[ast.expr]:
    if isinstance(fn, ast.Lambda):
        return [fn.body]
    return [n.value for n in own_nodes(fn) if isinstance(n, ast.Return) and n.value is not None]


def _same(a: ast.AST, b: ast.AST) -> bool:
    return ast.dump(a) == ast.dump(b)


def _last_index(value: ast.expr, table: ast.expr) -> bool:
    """``len(table) - 1`` (the index an append just took)."""
    return (
        isinstance(value, ast.BinOp)
        and isinstance(value.op, ast.Sub)
        and isinstance(value.left, ast.Call)
        and tail(value.left.func) == "len"
        and len(value.left.args) == 1
        and _same(value.left.args[0], table)
        and isinstance(value.right, ast.Constant)
        and value.right.value == 1
    )


def _returns_key(
    value: ast.expr, key: ast.expr | None, table: ast.expr, tainted: Iterable[str]
) -> bool:
    """Does the hook return the store's key (``key`` None: an append, whose key is the
    list's last index), alone or in a tuple beside nothing tensor-derived?"""

    def is_key(e: ast.expr) -> bool:
        return _last_index(e, table) if key is None else _same(e, key)

    if is_key(value):
        return True
    if isinstance(value, ast.Tuple):
        keyed = [e for e in value.elts if is_key(e)]
        return bool(keyed) and not any(_carries(e, tainted) for e in value.elts if not is_key(e))
    return False


def _stores(
    nodes: Iterable[ast.AST], tainted: Iterable[str]
) -> Iterator[tuple[ast.AST, ast.expr, ast.expr | None]]:
    """(node, table, key) where the hook stores the tensor: ``table[key] = t``,
    ``table.update({key: t})`` / ``table.update(key=t)`` (the key as a string constant),
    and ``table.append(t)`` (key None: the list's last index)."""
    for node in nodes:
        if isinstance(node, ast.Assign) and _carries(node.value, tainted):
            for t in node.targets:
                if isinstance(t, ast.Subscript):
                    yield node, t.value, t.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            table = node.func.value
            if node.func.attr == "append" and node.args and _carries(node.args[0], tainted):
                yield node, table, None
            elif node.func.attr == "update":
                for arg in node.args:
                    if isinstance(arg, ast.Dict):
                        for k, v in zip(arg.keys, arg.values):
                            if k is not None and _carries(v, tainted):
                                yield node, table, k
                for kw in node.keywords:
                    if kw.arg and _carries(kw.value, tainted):
                        yield node, table, ast.Constant(kw.arg)


def _empty_display(e: ast.AST) -> bool:
    return (isinstance(e, ast.Dict) and not e.keys) or (isinstance(e, ast.List) and not e.elts)


#: methods whose body clears a table at the start or end of each ``with`` block
_RESETS = ("__enter__", "__exit__")


def _cleared_per_block(hook: Target, attrs: list[str]) -> str | None:
    """The method (``__enter__``) of the hook's class that empties ``self.<attrs>``, if any."""
    classes = [s for s in hook.chain if isinstance(s, ast.ClassDef)]
    if not classes or not attrs:
        return None
    for stmt in classes[-1].body:
        if (
            not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
            or stmt.name not in _RESETS
        ):
            continue
        for n in own_nodes(stmt):
            target: ast.AST | None = None
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                if n.func.attr == "clear":
                    target = n.func.value
            elif isinstance(n, ast.Assign) and _empty_display(n.value):
                target = n.targets[0]
            if target is not None and root(target)[1] == attrs:
                return stmt.name
    return None


def _check_hook(
    hook: Target, project: Project, files: Callables, depth: int, seen: set[int]
) -> Iterator[ScanFinding]:
    if id(hook.fn) in seen:
        return
    seen.add(id(hook.fn))
    fn = hook.fn
    tainted = _taint(hook)
    module_names = bound_names(hook.source.tree)
    nodes = [fn.body] if isinstance(fn, ast.Lambda) else list(own_nodes(fn))
    returns = _returns(fn)
    reported: set[str] = set()
    stores = sorted(_stores(nodes, tainted), key=lambda s: (s[0].lineno, s[0].col_offset))  # type: ignore[attr-defined]
    for node, table, key in stores:
        if not any(_returns_key(r, key, table, tainted) for r in returns):
            continue
        symbol = _table_symbol(hook, table, module_names)
        if symbol is None or symbol in reported or _weak_table(hook.source.tree, table):
            continue
        reported.add(symbol)
        reset = _cleared_per_block(hook, root(table)[1])
        how_long = (
            f"until {reset} clears it at the next `with` block"
            if reset
            else "for the manager's life"
        )
        yield hook.source.finding(
            node,
            CODE,
            symbol,
            MESSAGE.format(table=symbol, how_long=how_long),
            evidence=f"the pack hook parks the saved tensor in {symbol} and returns a key; a "
            f"graph freed without backward leaves it there {how_long}",
        )
    if depth >= 2:
        return
    for value in returns:
        for call in _returned_calls(value, nodes):
            yield from _follow(hook, call, tainted, project, files, depth, seen)


def _returned_calls(value: ast.expr, nodes: Sequence[ast.AST]) -> list[ast.expr]:
    """The calls whose result the hook returns: ``return self._pack(t)``, or through a
    name (verl's ``tag = self.offload_handler.tensor_push(t); return tag``)."""
    if not isinstance(value, ast.Name):
        return [value]
    return [
        n.value
        for n in nodes
        if isinstance(n, ast.Assign)
        and isinstance(n.value, ast.Call)
        and any(isinstance(t, ast.Name) and t.id == value.id for t in n.targets)
    ]


def _follow(
    hook: Target,
    value: ast.expr,
    tainted: Iterable[str],
    project: Project,
    files: Callables,
    depth: int,
    seen: set[int],
) -> Iterator[ScanFinding]:
    """``return self._pack(t)``: check the called function with the tensor's parameter."""
    if not isinstance(value, ast.Call):
        return
    positions = [i for i, a in enumerate(value.args) if _carries(a, tainted)]
    if len(positions) != 1:
        return
    name = tail(value.func)
    if not name:
        return
    for src, callee in project.helpers(name):
        chain = files.scopes_of(src).chain(callee)
        params = positional(callee)
        is_method = Scopes.is_method(callee, chain)
        if is_method != isinstance(value.func, ast.Attribute):
            continue
        index = positions[0] + (1 if is_method else 0)
        if index < len(params):
            inner = Target(src, callee, chain, tuple(params[index:]))
            yield from _check_hook(inner, project, files, depth + 1, seen)


#: a file registers a pack hook only if its text names one of these (a cheap prefilter)
_MARKERS = ("saved_tensors_hooks", "saved_tensors_default_hooks", "pack_hook", "_raw_saved_")


def check(source: Source, project: Project) -> Iterable[ScanFinding]:
    if not any(m in source.text for m in _MARKERS):
        return []
    resolver = Callables(source, project)
    seen: set[int] = set()
    found: dict[tuple[str, int, str], ScanFinding] = {}
    for hook in _registrations(source, resolver):
        for f in _check_hook(hook, project, resolver, 0, seen):
            found.setdefault((f.path, f.line, f.symbol), f)
    return sorted(found.values())


RULES: tuple[ScanRule, ...] = (
    ScanRule(
        code=CODE,
        name="pack-hook-key-table",
        summary=(
            "a saved-tensor pack hook stores the tensor in a long-lived table and returns "
            "a key into it: the table, not the graph, owns the payload"
        ),
        confirm=CONFIRM,
        check=check,
        needs=("saved_tensors_hooks", "saved_tensors_default_hooks", "pack_hook", "register_hooks"),
        fix="return an object that owns the payload (leakfree.OffloadActivations does)",
    ),
)
