"""The one syntax layer every rule reads code through: names, scopes, imports, autograd
Function classes and annotations.

Everything here reads :mod:`ast` only; nothing is imported or evaluated. What a value can
*hold* (tensors, a loss) is :mod:`leakfree.scan._flow`'s business, built on these.

* **Names.** :func:`dotted` (``a.b.c``), :func:`tail` (``c``), :func:`root` (the variable a
  container expression is reached from: ``self.tracker[k]`` -> ``self``, ``["tracker"]``).
* **Scopes.** :func:`own_nodes` (a function's body without nested scopes, which run at
  another time with other names), :func:`functions` (every function with the class it is a
  method of), :class:`Scopes` (each node's chain of enclosing classes and functions),
  :func:`bound_names`.
* **Imports.** :func:`imports` maps local names to what they were imported as (relative
  imports resolved); :func:`resolve` applies it to an expression.
* **Autograd Functions.** :func:`function_classes` is the one decision of "is this class
  a ``torch.autograd.Function``", used by every rule.
* **Annotations.** :func:`plain_annotation`: numbers, strings, bools, dtypes, devices and
  tuples or lists of them are not tensors, whatever the code does with them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

__all__ = [
    "FunctionClass",
    "FunctionNode",
    "Scopes",
    "attr_of",
    "bound_names",
    "calls_on",
    "dotted",
    "elements",
    "function_classes",
    "functions",
    "imports",
    "own_nodes",
    "parameters",
    "plain_annotation",
    "resolve",
    "root",
    "statements",
    "tail",
    "words",
]

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef
Scope = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def words(text: str) -> frozenset[str]:
    """A set of names written as one space-separated string (long tables stay compact)."""
    return frozenset(text.split())


def name_words(name: str) -> set[str]:
    """``total_loss`` -> {"total", "loss"}: the lower-cased words of an identifier."""
    return {w for w in name.lower().strip("_").split("_") if w}


# --- names ---------------------------------------------------------------------------


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def tail(node: ast.AST) -> str:
    """The last name of ``a.b.c`` / ``c``; empty for anything else."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


#: calls that read a container's entry (``d.setdefault(k, [])``), walked through by root()
_ENTRY_CALLS = frozenset({"setdefault", "get", "__getitem__"})


def root(node: ast.AST) -> tuple[ast.Name | None, list[str]]:
    """The variable a container expression is reached from, and the attribute names on the
    way (outer last): ``self.tracker[k]`` and ``self.tracker.setdefault(k, [])`` give
    (``self``, ["tracker"]). Subscripts and entry look-ups are walked through."""
    path: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            path.append(node.attr)
            node = node.value
        elif isinstance(node, (ast.Subscript, ast.Starred)):
            node = node.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _ENTRY_CALLS
        ):
            node = node.func.value
        else:
            break
    path.reverse()
    return (node if isinstance(node, ast.Name) else None), path


def symbol(node: ast.AST) -> str:
    """``context.losses[name]`` -> ``context.losses``: a container, named without keys."""
    base, path = root(node)
    return ".".join([base.id, *path]) if base is not None else ast.unparse(node)


def attr_of(e: ast.AST, owners: set[str]) -> str | None:
    """``a`` for ``x.a`` where ``x`` is one of ``owners`` (a ctx and its aliases), else None."""
    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id in owners:
        return e.attr
    return None


def calls_on(
    nodes: Iterable[ast.AST], owners: set[str], methods: Iterable[str]
) -> Iterator[tuple[ast.Call, str]]:
    """``(call, method)`` for each ``x.method(...)`` among ``nodes`` where ``x`` is one of
    ``owners`` (a ctx and its aliases: ``ctx.save_for_backward(...)``)."""
    wanted = set(methods)
    for n in nodes:
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name)
            and n.func.value.id in owners
            and n.func.attr in wanted
        ):
            yield n, n.func.attr


def elements(e: ast.AST) -> Iterator[ast.AST]:
    """The leaves of a tuple / list display (``a, (b, *c)``: a, b, c); anything else is
    its own one element."""
    if isinstance(e, (ast.Tuple, ast.List)):
        for v in e.elts:
            yield from elements(v.value if isinstance(v, ast.Starred) else v)
    else:
        yield e


def parameters(fn: FunctionNode | ast.Lambda) -> list[ast.arg]:
    """Positional parameters in order (positional-only first), then keyword-only."""
    a = fn.args
    return [*a.posonlyargs, *a.args, *a.kwonlyargs]


def positional(fn: FunctionNode | ast.Lambda) -> list[str]:
    """The names of the positional parameters, in order."""
    return [p.arg for p in (*fn.args.posonlyargs, *fn.args.args)]


def is_static(fn: FunctionNode) -> bool:
    return any(dotted(d) in ("staticmethod", "classmethod") for d in fn.decorator_list)


# --- scopes --------------------------------------------------------------------------


def own_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every node under ``node`` (a function's body, a lambda's expression, a loop, a
    module), not entering nested functions, lambdas or classes: they run at another
    time, with other names. A function's decorators and defaults are not its body."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        stack: list[ast.AST] = list(reversed(node.body))
    elif isinstance(node, ast.Lambda):
        stack = [node.body]
    else:
        stack = list(reversed(list(ast.iter_child_nodes(node))))
    while stack:
        n = stack.pop()
        yield n
        if not isinstance(n, _SCOPES):
            stack.extend(reversed(list(ast.iter_child_nodes(n))))


def bound_names(scope: ast.AST) -> set[str]:
    """Names bound in ``scope``'s own body: targets, loop variables, imports, nested
    definitions (a function's parameters are :func:`positional`'s)."""
    names: set[str] = set()
    for node in own_nodes(scope):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def declared(scope: ast.AST, kind: type[ast.Global] | type[ast.Nonlocal]) -> set[str]:
    """Names a scope declares ``global`` (or ``nonlocal``)."""
    return {n for node in own_nodes(scope) if isinstance(node, kind) for n in node.names}


_BLOCKS = ("body", "orelse", "finalbody", "handlers", "cases")


def statements(tree: ast.Module) -> Iterator[ast.stmt]:
    """Every statement of a file, nested ones included, without walking expressions (a
    tenth of the nodes): imports, classes and functions are statements."""
    stack: list[ast.AST] = list(reversed(tree.body))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.stmt):
            yield node
        for name in _BLOCKS:
            inner = getattr(node, name, None)
            if inner:
                stack.extend(reversed(inner))


def functions(tree: ast.Module) -> Iterator[tuple[FunctionNode, ast.ClassDef | None]]:
    """Every function with the class it is a method of (None for plain and nested
    functions). Only statement blocks are visited: functions are defined by statements."""

    def visit(
        block: list[ast.stmt], cls: ast.ClassDef | None
    ) -> Iterator[tuple[FunctionNode, ast.ClassDef | None]]:
        for node in block:
            if isinstance(node, ast.ClassDef):
                yield from visit(node.body, node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield node, cls
                yield from visit(node.body, None)
            else:
                for name in _BLOCKS:
                    inner = getattr(node, name, None)
                    if inner:
                        yield from visit(inner, cls)

    yield from visit(tree.body, None)


class Scopes:
    """Each function, lambda, class and call of a file with its chain of enclosing classes
    and functions (outermost first), computed once per file on first use."""

    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self._chains: dict[int, tuple[Scope, ...]] | None = None

    def chain(self, node: ast.AST) -> tuple[Scope, ...]:
        if self._chains is None:
            self._chains = {}
            self._visit(self.tree, ())
        return self._chains.get(id(node), ())

    def _visit(self, node: ast.AST, chain: tuple[Scope, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _SCOPES):
                self._chains[id(child)] = chain  # type: ignore[index]
                self._visit(child, (*chain, child))
            else:
                if isinstance(child, ast.Call):
                    self._chains[id(child)] = chain  # type: ignore[index]
                self._visit(child, chain)

    @staticmethod
    def is_method(fn: ast.AST, chain: tuple[Scope, ...]) -> bool:
        """Is ``fn`` (enclosed by ``chain``) a method that receives its instance first?"""
        if not (chain and isinstance(chain[-1], ast.ClassDef)):
            return False
        decorators = getattr(fn, "decorator_list", [])
        return not any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in decorators)

    @classmethod
    def class_of_self(cls, name: str, chain: tuple[Scope, ...]) -> ast.ClassDef | None:
        """The class whose instance ``name`` is in the innermost scope of ``chain``: the
        first parameter of the method that encloses it, unless rebound on the way."""
        for i in range(len(chain) - 1, 0, -1):
            fn, owner = chain[i], chain[i - 1]
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and isinstance(
                owner, ast.ClassDef
            ):
                params = positional(fn)
                if params and params[0] == name and cls.is_method(fn, chain[:i]):
                    return owner
            if not isinstance(fn, ast.ClassDef) and (
                name in bound_names(fn) or name in positional(fn)  # type: ignore[arg-type]
            ):
                return None
        return None


# --- imports -------------------------------------------------------------------------


def imports(tree: ast.Module, package: str = "") -> dict[str, str]:
    """Local name -> the dotted name it was imported as (module level and nested imports;
    relative imports resolved against ``package``, the package the file lies in:
    :attr:`Source.package <leakfree.scan._model.Source.package>`)."""
    out: dict[str, str] = {}
    for node in statements(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = a.name
                else:
                    head = a.name.split(".", 1)[0]
                    out[head] = head
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node, package)
            for a in node.names:
                out[a.asname or a.name] = f"{base}.{a.name}" if base else a.name
    return out


def absolute(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` reads from, its relative levels resolved against
    ``package`` (the importing file's package)."""
    base = node.module or ""
    if not node.level:
        return base
    parts = package.split(".") if package else []
    parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
    return ".".join([*parts, base] if base else parts)


def resolve(node: ast.AST, names: dict[str, str]) -> str | None:
    """The dotted name of ``node`` with its first part replaced by what it was imported as."""
    d = dotted(node)
    if d is None:
        return None
    head, _, rest = d.partition(".")
    full = names.get(head, head)
    return f"{full}.{rest}" if rest else full


# --- annotations ---------------------------------------------------------------------

#: annotation names that never hold a tensor
_PLAIN_TYPES = words(
    "int float bool str bytes complex None NoneType dtype device Size Number SymInt "
    "SymFloat SymBool Literal ProcessGroup Callable Enum"
)
#: generic wrappers whose arguments decide (Optional[float], tuple[int, ...])
_WRAPPERS = words("Optional Union Tuple tuple List list Sequence Iterable Final Annotated")


def plain_annotation(ann: ast.AST | None) -> bool:
    """Does the annotation say the value holds no tensor? Numbers, strings, bools, None,
    dtypes, devices, sizes, process groups, callables, and tuples / lists / unions /
    optionals made of those (``Optional[float]``, ``tuple[int, ...]``, ``int | None``)."""
    if ann is None:
        return False
    if isinstance(ann, ast.Constant):
        if isinstance(ann.value, str):  # a string annotation: parse it
            try:
                return plain_annotation(ast.parse(ann.value, mode="eval").body)
            except SyntaxError:
                return False
        return ann.value is None or ann.value is Ellipsis
    if isinstance(ann, (ast.Name, ast.Attribute)):
        return tail(ann) in _PLAIN_TYPES
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        return plain_annotation(ann.left) and plain_annotation(ann.right)
    if isinstance(ann, ast.Subscript):
        if tail(ann.value) in ("Literal", "Callable"):
            return True
        if tail(ann.value) not in _WRAPPERS:
            return False
        inner = ann.slice
        parts = inner.elts if isinstance(inner, ast.Tuple) else [inner]
        return all(plain_annotation(p) for p in parts)
    return False


# --- autograd Function classes -------------------------------------------------------

#: dotted names of PyTorch's Function base classes
AUTOGRAD_BASES = words(
    "torch.autograd.Function torch.autograd.function.Function "
    "torch.autograd.function.InplaceFunction torch.autograd.function._SingleLevelFunction "
    "autograd.Function function.Function"
)


@dataclass
class FunctionClass:
    """A class that is (or is taken to be) a ``torch.autograd.Function``.

    ``releases`` is true for :class:`leakfree.Function` subclasses and classes handed to
    ``leakfree.release_after_backward`` in the same file: their ctx state is released at
    run time. ``methods`` holds the class's own methods and those of same-file bases.
    """

    node: ast.ClassDef
    releases: bool
    methods: dict[str, FunctionNode] = field(default_factory=dict)

    def method(self, name: str) -> FunctionNode | None:
        return self.methods.get(name)


def _own_methods(cls: ast.ClassDef) -> dict[str, FunctionNode]:
    return {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def function_classes(tree: ast.Module, names: dict[str, str]) -> list[FunctionClass]:
    """The autograd Function classes defined in ``tree`` (``names``: :func:`imports`).

    A base counts when it resolves (through the file's imports) to PyTorch's Function, to
    ``leakfree.Function`` (then ``releases`` is set), or to a class of this file that
    counts. A base of another name ending in ``Function`` (a project's own base, or an
    unresolved ``Function``) counts only with the shape of one: a static ``forward`` (or
    ``setup_context``) whose first parameter is the ctx, and a ``backward`` or ``vjp``.
    That keeps ``sympy.Function`` and similar out.
    """
    classes: dict[str, ast.ClassDef] = {}
    released: set[str] = set()  # classes handed to release_after_backward
    for node in statements(tree):
        if isinstance(node, ast.ClassDef):
            classes.setdefault(node.name, node)
            for d in node.decorator_list:
                f = resolve(d.func if isinstance(d, ast.Call) else d, names) or ""
                if f.rsplit(".", 1)[-1] == "release_after_backward":
                    released.add(node.name)
        elif isinstance(node, (ast.Expr, ast.Assign)):
            # ``release_after_backward(Theirs)``, as a statement or assigned
            call = node.value
            if isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.Name):
                f = resolve(call.func, names) or ""
                if f.rsplit(".", 1)[-1] == "release_after_backward":
                    released.add(call.args[0].id)
    memo: dict[str, tuple[bool, bool] | None] = {}

    def kind(cls: ast.ClassDef, seen: frozenset[str]) -> tuple[bool, bool] | None:
        # (is a Function, releases); None when not a Function
        if cls.name in memo:
            return memo[cls.name]
        result: tuple[bool, bool] | None = None
        for base in cls.bases:
            full = resolve(base, names)
            if full is None:
                continue
            if full.startswith("leakfree.") and full.endswith("Function"):
                result = (True, True)
            elif full in AUTOGRAD_BASES:
                result = result or (True, False)
            elif isinstance(base, ast.Name) and base.id in classes and base.id not in seen:
                inner = kind(classes[base.id], seen | {cls.name})
                if inner is not None:
                    result = (True, inner[1] or (result or (False, False))[1])
            elif full.rsplit(".", 1)[-1].endswith("Function") and _has_shape(cls):
                result = result or (True, False)
        if result is not None and cls.name in released:
            result = (True, True)
        memo[cls.name] = result
        return result

    out = []
    for cls in classes.values():
        k = kind(cls, frozenset())
        if k is None:
            continue
        methods: dict[str, FunctionNode] = {}
        for chain in reversed(_base_chain(cls, classes)):  # the class's own methods win
            methods.update(_own_methods(chain))
        out.append(FunctionClass(cls, k[1], methods))
    return out


def _base_chain(cls: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> list[ast.ClassDef]:
    chain, todo, seen = [], [cls], set()
    while todo:
        c = todo.pop(0)
        if c.name in seen:
            continue
        seen.add(c.name)
        chain.append(c)
        todo.extend(classes[b.id] for b in c.bases if isinstance(b, ast.Name) and b.id in classes)
    return chain


def _has_shape(cls: ast.ClassDef) -> bool:
    m = _own_methods(cls)
    entry = m.get("setup_context") or m.get("forward")
    return (
        entry is not None
        and is_static(entry)
        and bool(parameters(entry))
        and ("backward" in m or "vjp" in m)
    )
