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
- **A long-lived table**: a subscript store whose container is reached from the
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
  holding it beside nothing tensor-derived), so a store that is not the one the key
  indexes is not reported. A hook returning the tensor itself or a handle object is
  silent, whatever else it records.

When the hook's return value is a call (``return self._pack(t)``, ``return
manager.offload(t)``) that receives the tensor, the called function is checked the same
way (two levels deep), by name in the scanned tree. Clearing the table in ``unpack`` or
``__enter__`` does not silence the rule: it cannot run for a graph freed without backward.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from leakfree.scan._model import Finding, Project, Rule, Source

__all__ = ["RULES"]

CODE = "LF004"
CONFIRM = "leakfree.testing.assert_no_leak"

_FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef
_Scope = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda

#: calls whose first argument is a pack hook
_REGISTER = frozenset({"saved_tensors_hooks", "_push_saved_tensors_default_hooks"})
#: tensor attributes that are metadata, not the payload
_META_ATTRS = frozenset(
    {
        "shape",
        "dtype",
        "device",
        "layout",
        "requires_grad",
        "is_leaf",
        "is_cuda",
        "ndim",
        "names",
        "_version",
        "is_sparse",
        "is_quantized",
        "is_meta",
        "grad_fn",
        "itemsize",
        "nbytes",
    }
)
#: tensor methods whose result is metadata
_META_METHODS = frozenset(
    {
        "size",
        "stride",
        "dim",
        "numel",
        "nelement",
        "element_size",
        "storage_offset",
        "data_ptr",
        "is_contiguous",
        "get_device",
        "is_floating_point",
        "is_complex",
        "untyped_storage",  # only ever followed by data_ptr()/nbytes() in key code
        "_typed_storage",
    }
)
#: builtins / functions whose result holds no tensor (or only weakly)
_META_CALLS = frozenset(
    {
        "id",
        "len",
        "isinstance",
        "type",
        "hash",
        "str",
        "repr",
        "int",
        "float",
        "bool",
        "ref",  # weakref.ref(t)
        "WeakMethod",
        "StorageWeakRef",
        "hasattr",
    }
)

MESSAGE = (
    "the pack hook stores the saved tensor in {table} and returns a key into it, so the "
    "table, not the graph, owns the payload: a graph freed without backward leaves it "
    "there for the manager's life; return an object that owns the payload instead (as "
    "leakfree.offload.OffloadActivations does)"
)


# --- scopes ---------------------------------------------------------------------------


def _parents(tree: ast.Module) -> dict[ast.AST, tuple[_Scope, ...]]:
    """For every function, lambda and call: the chain of enclosing classes / functions."""
    out: dict[ast.AST, tuple[_Scope, ...]] = {}

    def visit(node: ast.AST, chain: tuple[_Scope, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                out[child] = chain
                visit(child, (*chain, child))
            else:
                if isinstance(child, ast.Call):
                    out[child] = chain
                visit(child, chain)

    visit(tree, ())
    return out


def _own_nodes(fn: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``fn``'s body, not entering nested functions, lambdas or classes."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def _params(fn: _FunctionNode | ast.Lambda) -> list[str]:
    a = fn.args
    return [p.arg for p in (*a.posonlyargs, *a.args)]


def _is_method(fn: ast.AST, chain: tuple[_Scope, ...]) -> bool:
    if not (chain and isinstance(chain[-1], ast.ClassDef)):
        return False
    decorators = getattr(fn, "decorator_list", [])
    return not any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in decorators)


def _assigned(fn: ast.AST) -> set[str]:
    """Names bound in ``fn``'s own body (targets, loop variables, imports, nested defs)."""
    names: set[str] = set()
    for node in _own_nodes(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _declared(fn: ast.AST, kind: type[ast.Global] | type[ast.Nonlocal]) -> set[str]:
    return {n for node in _own_nodes(fn) if isinstance(node, kind) for n in node.names}


def _module_names(tree: ast.Module) -> set[str]:
    """Names bound at module level (under ``if`` / ``try`` too, not inside functions)."""
    return _assigned(tree)


# --- the hook function ----------------------------------------------------------------


@dataclass(frozen=True)
class _Hook:
    source: Source
    fn: _FunctionNode | ast.Lambda
    chain: tuple[_Scope, ...]
    param: str  #: the parameter that receives the saved tensor
    bound: tuple[str, ...] = ()  #: parameters bound by functools.partial (live as long)


def _hook_from(
    fn: _FunctionNode | ast.Lambda,
    chain: tuple[_Scope, ...],
    source: Source,
    skip_self: bool,
    bound: int = 0,
) -> _Hook | None:
    """The hook ``fn``; ``bound`` leading parameters are bound by ``functools.partial``."""
    params = _params(fn)
    if skip_self and _is_method(fn, chain):
        params = params[1:]
    bound_names = tuple(params[:bound])
    params = params[bound:]
    return _Hook(source, fn, chain, params[0], bound_names) if params else None


class _Parents:
    """``_parents`` of each file, computed once per check."""

    def __init__(self) -> None:
        self._by_tree: dict[int, dict[ast.AST, tuple[_Scope, ...]]] = {}

    def of(self, source: Source) -> dict[ast.AST, tuple[_Scope, ...]]:
        found = self._by_tree.get(id(source.tree))
        if found is None:
            found = self._by_tree[id(source.tree)] = _parents(source.tree)
        return found


class _Resolver:
    """Finds the function behind a pack-hook expression, in the file or the project."""

    def __init__(self, source: Source, project: Project, parents: _Parents) -> None:
        self.source = source
        self.project = project
        self.all_parents = parents
        self.parents = parents.of(source)

    def chain(self, node: ast.AST) -> tuple[_Scope, ...]:
        return self.parents.get(node, ())

    def resolve(
        self, expr: ast.expr, chain: tuple[_Scope, ...], depth: int = 0, bound: int = 0
    ) -> _Hook | None:
        if isinstance(expr, ast.Lambda):
            return _hook_from(expr, self.chain(expr), self.source, False, bound)
        if isinstance(expr, ast.Name):
            fn = self._find_def(expr.id, chain)
            if fn is not None:
                return _hook_from(fn, self.chain(fn), self.source, True, bound)
            for src, other in self.project.helpers(expr.id):
                if src is not self.source:
                    chain_there = self.all_parents.of(src).get(other, ())
                    return _hook_from(other, chain_there, src, True, bound)
            return None
        if (
            isinstance(expr, ast.Call)
            and _dotted_tail(expr.func) == "partial"
            and expr.args
            and not expr.keywords
        ):
            # functools.partial(pack, a, b): the tensor is the first parameter not bound
            return self.resolve(expr.args[0], chain, depth, bound + len(expr.args) - 1)
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            cls = _enclosing_class_of_self(expr.value.id, chain)
            if cls is not None:
                for stmt in cls.body:
                    if (
                        isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and stmt.name == expr.attr
                    ):
                        inner = (*self.chain(cls), cls)
                        return _hook_from(stmt, inner, self.source, True, bound)
            return None
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and depth < 2:
            # a factory: ``make_pack(...)`` returning a nested ``def pack``
            factory = self._find_def(expr.func.id, chain)
            if factory is None:
                return None
            for node in _own_nodes(factory):
                if isinstance(node, ast.Return) and node.value is not None:
                    inner = (*self.chain(factory), factory)
                    return self.resolve(node.value, inner, depth + 1)
        return None

    def _find_def(self, name: str, chain: tuple[_Scope, ...]) -> _FunctionNode | None:
        scopes: list[ast.AST] = [s for s in reversed(chain) if not isinstance(s, ast.ClassDef)]
        scopes.append(self.source.tree)
        for scope in scopes:
            for node in _own_nodes(scope):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    return node
        return None


def _enclosing_class_of_self(name: str, chain: tuple[_Scope, ...]) -> ast.ClassDef | None:
    """The class whose instance ``name`` is: the first parameter of a method in ``chain``."""
    for i in range(len(chain) - 1, 0, -1):
        fn, owner = chain[i], chain[i - 1]
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and isinstance(
            owner, ast.ClassDef
        ):
            params = _params(fn)
            if params and params[0] == name and _is_method(fn, chain[:i]):
                return owner
            if name in _assigned(fn) or name in params:
                return None
    return None


def _registrations(source: Source, resolver: _Resolver) -> Iterator[_Hook]:
    """Every pack hook registered in ``source``."""
    for node in ast.walk(source.tree):
        if not isinstance(node, ast.Call):
            continue
        chain = resolver.chain(node)
        pack: ast.expr | None = None
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
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
    node: ast.Call, func: ast.Attribute, chain: tuple[_Scope, ...]
) -> ast.expr | None:
    classes = [s for s in chain if isinstance(s, ast.ClassDef)]
    if not classes or not any(_dotted_tail(b) == "saved_tensors_hooks" for b in classes[-1].bases):
        return None
    base = func.value
    if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
        return node.args[0] if node.args else None
    if _dotted_tail(base) == "saved_tensors_hooks":  # saved_tensors_hooks.__init__(self, p, u)
        return node.args[1] if len(node.args) > 1 else None
    return None


def _dotted_tail(expr: ast.expr) -> str:
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return expr.id if isinstance(expr, ast.Name) else ""


# --- what the hook does ---------------------------------------------------------------


def _carries(expr: ast.AST, tainted: set[str]) -> bool:
    """Whether ``expr`` can hold (a copy of) a tainted tensor, not just its metadata."""
    if isinstance(expr, ast.Name):
        return expr.id in tainted
    if isinstance(expr, ast.Attribute):
        if expr.attr in _META_ATTRS:
            return False
        return _carries(expr.value, tainted)
    if isinstance(expr, ast.Call):
        f = expr.func
        fname = _dotted_tail(f)
        if fname in _META_CALLS:
            return False
        if isinstance(f, ast.Attribute) and fname in _META_METHODS:
            return False
        parts: list[ast.AST] = [*expr.args, *(k.value for k in expr.keywords)]
        if isinstance(f, ast.Attribute):
            parts.append(f.value)
        return any(_carries(p, tainted) for p in parts)
    if isinstance(expr, (ast.Compare, ast.BoolOp)) and not isinstance(expr, ast.BoolOp):
        return False  # a comparison is a bool
    if isinstance(expr, ast.Lambda):
        return False
    return any(_carries(c, tainted) for c in ast.iter_child_nodes(expr))


def _taint(fn: ast.AST, param: str) -> set[str]:
    tainted = {param}
    assigns = [
        n for n in _own_nodes(fn) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.NamedExpr))
    ]
    assigns.sort(key=lambda n: (n.lineno, n.col_offset))
    for _ in range(2):  # a value can flow back through a loop
        for node in assigns:
            if node.value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if _carries(node.value, tainted):
                for t in targets:
                    if isinstance(t, (ast.Tuple, ast.List)) and isinstance(
                        node.value, (ast.Tuple, ast.List)
                    ):
                        for sub_t, sub_v in zip(t.elts, node.value.elts):
                            if isinstance(sub_t, ast.Name) and _carries(sub_v, tainted):
                                tainted.add(sub_t.id)
                    else:
                        tainted.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return tainted


def _root(expr: ast.expr) -> tuple[ast.Name | None, list[str]]:
    """``self.a.b`` -> (Name self, ["a", "b"]); subscripts along the way are skipped."""
    attrs: list[str] = []
    while isinstance(expr, (ast.Attribute, ast.Subscript)):
        if isinstance(expr, ast.Attribute):
            attrs.append(expr.attr)
        expr = expr.value
    attrs.reverse()
    return (expr if isinstance(expr, ast.Name) else None), attrs


def _table_symbol(hook: _Hook, table: ast.expr, module_names: set[str]) -> str | None:
    """The long-lived table's symbol (``Class.attr``, a global, ``func.var``), or None when
    ``table`` is local to the hook."""
    name, attrs = _root(table)
    if name is None:
        return None
    fn = hook.fn
    local = set(_params(fn)) | _assigned(fn)
    if name.id in _declared(fn, ast.Global):
        return ".".join([name.id, *attrs])
    own_chain = (*hook.chain, fn) if not isinstance(fn, ast.Lambda) else hook.chain
    if name.id in hook.bound:  # bound by partial: it lives as long as the hook
        label = fn.name if not isinstance(fn, ast.Lambda) else "<lambda>"
        return ".".join([label, name.id, *attrs])
    if name.id in local and name.id not in _declared(fn, ast.Nonlocal):
        # the hook's own parameter: ``self`` of a method hook
        cls = _enclosing_class_of_self(name.id, own_chain) if attrs else None
        return ".".join([cls.name, *attrs]) if cls is not None else None
    # a free variable: an enclosing function's (its ``self``, or a closure variable)
    for scope in reversed(hook.chain):
        if isinstance(scope, ast.ClassDef):
            continue
        if name.id in _params(scope) or name.id in _assigned(scope):
            cls = _enclosing_class_of_self(name.id, own_chain) if attrs else None
            if cls is not None:
                return ".".join([cls.name, *attrs])
            label = scope.name if not isinstance(scope, ast.Lambda) else "<lambda>"
            return ".".join([label, name.id, *attrs])
    if name.id in module_names:
        return ".".join([name.id, *attrs])
    return None


_WEAK_TABLES = frozenset({"WeakKeyDictionary", "WeakValueDictionary", "WeakSet"})


def _weak_table(tree: ast.Module, table: ast.expr) -> bool:
    """Whether ``table``'s name is bound to a weak container anywhere in the file (the
    graph owns a handle key, and the entry goes with it: ``allow_mutation_on_saved_tensors``)."""
    name = _dotted_tail(table)
    if not name:
        return False
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call):
            if _dotted_tail(node.value.func) not in _WEAK_TABLES:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_dotted_tail(t) == name for t in targets):
                return True
    return False


def _returns(fn: _FunctionNode | ast.Lambda) -> list[ast.expr]:
    if isinstance(fn, ast.Lambda):
        return [fn.body]
    return [n.value for n in _own_nodes(fn) if isinstance(n, ast.Return) and n.value is not None]


def _returns_key(value: ast.expr, key: ast.expr, tainted: set[str]) -> bool:
    want = ast.dump(key)
    if ast.dump(value) == want:
        return True
    if isinstance(value, ast.Tuple):
        keyed = [e for e in value.elts if ast.dump(e) == want]
        rest = [e for e in value.elts if ast.dump(e) != want]
        return bool(keyed) and not any(_carries(e, tainted) for e in rest)
    return False


def _check_hook(
    hook: _Hook, project: Project, parents: _Parents, depth: int, seen: set[int]
) -> Iterator[Finding]:
    if id(hook.fn) in seen:
        return
    seen.add(id(hook.fn))
    fn = hook.fn
    tainted = _taint(fn, hook.param)
    module_names = _module_names(hook.source.tree)
    stores: list[tuple[ast.Assign, ast.expr, ast.expr]] = []  # (node, table, key)
    nodes = [fn.body] if isinstance(fn, ast.Lambda) else list(_own_nodes(fn))
    for node in nodes:
        if isinstance(node, ast.Assign) and _carries(node.value, tainted):
            for t in node.targets:
                if isinstance(t, ast.Subscript):
                    stores.append((node, t.value, t.slice))
    returns = _returns(fn)
    reported: set[str] = set()
    for node, table, key in sorted(stores, key=lambda s: (s[0].lineno, s[0].col_offset)):
        if not any(_returns_key(r, key, tainted) for r in returns):
            continue
        symbol = _table_symbol(hook, table, module_names)
        if symbol is None or symbol in reported or _weak_table(hook.source.tree, table):
            continue
        reported.add(symbol)
        yield hook.source.finding(node, CODE, symbol, MESSAGE.format(table=symbol))
    if depth >= 2:
        return
    for value in returns:
        yield from _follow(hook, value, tainted, project, parents, depth, seen)


def _follow(
    hook: _Hook,
    value: ast.expr,
    tainted: set[str],
    project: Project,
    parents: _Parents,
    depth: int,
    seen: set[int],
) -> Iterator[Finding]:
    """``return self._pack(t)``: check the called function with the tensor's parameter."""
    if not isinstance(value, ast.Call):
        return
    positions = [i for i, a in enumerate(value.args) if _carries(a, tainted)]
    if len(positions) != 1:
        return
    name = _dotted_tail(value.func)
    if not name:
        return
    for src, callee in project.helpers(name):
        chain = parents.of(src).get(callee, ())
        params = _params(callee)
        is_method = _is_method(callee, chain)
        if is_method != isinstance(value.func, ast.Attribute):
            continue
        offset = 1 if is_method else 0
        index = positions[0] + offset
        if index < len(params):
            inner = _Hook(src, callee, chain, params[index])
            yield from _check_hook(inner, project, parents, depth + 1, seen)


#: a file registers a pack hook only if its text names one of these (a cheap prefilter)
_MARKERS = ("saved_tensors_hooks", "saved_tensors_default_hooks", "pack_hook", "_raw_saved_")


def check(source: Source, project: Project) -> Iterable[Finding]:
    if not any(m in source.text for m in _MARKERS):
        return []
    parents = _Parents()
    resolver = _Resolver(source, project, parents)
    seen: set[int] = set()
    found: dict[tuple[str, int, str], Finding] = {}
    for hook in _registrations(source, resolver):
        for f in _check_hook(hook, project, parents, 0, seen):
            found.setdefault((f.path, f.line, f.symbol), f)
    return sorted(found.values())


RULES: tuple[Rule, ...] = (
    Rule(
        code=CODE,
        name="pack-hook-key-table",
        summary=(
            "a saved-tensor pack hook stores the tensor in a long-lived table and returns "
            "a key into it: the table, not the graph, owns the payload"
        ),
        confirm=CONFIRM,
        check=check,
        needs=("saved_tensors_hooks", "pack_hook", "register_hooks"),
    ),
)
