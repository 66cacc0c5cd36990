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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

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


# --- walking ----------------------------------------------------------------------

#: node type -> its fields that can hold nodes (``ctx`` and plain strings left out)
_CHILD_FIELDS: dict[type, tuple[str, ...]] = {}
_LEAF_FIELDS = frozenset({"ctx", "id", "attr", "arg", "name", "module", "type_comment", "kind"})


def _fields(cls: type[ast.AST]) -> tuple[str, ...]:
    found = _CHILD_FIELDS.get(cls)
    if found is None:
        found = _CHILD_FIELDS[cls] = tuple(f for f in cls._fields if f not in _LEAF_FIELDS)
    return found


def children(node: ast.AST) -> list[ast.AST]:
    """The child nodes of ``node`` in source order (as :func:`ast.iter_child_nodes`,
    without the ``Load``/``Store`` markers)."""
    out: list[ast.AST] = []
    for f in _fields(type(node)):
        v = getattr(node, f, None)
        if isinstance(v, ast.AST):
            out.append(v)
        elif isinstance(v, list):
            out.extend(x for x in v if isinstance(x, ast.AST))
    return out


def walk(node: ast.AST) -> Iterator[ast.AST]:
    """``node`` and every node under it, parent before children, in source order. The
    rules' hot loop: about three times :func:`ast.walk`'s speed, which builds a generator
    per node."""
    stack = [node]
    pop, push, grow = stack.pop, stack.append, stack.extend
    while stack:
        n = pop()
        yield n
        for f in reversed(_fields(type(n))):
            v = getattr(n, f, None)
            if isinstance(v, ast.AST):
                push(v)
            elif isinstance(v, list) and v:
                grow(x for x in reversed(v) if isinstance(x, ast.AST))


# --- scopes --------------------------------------------------------------------------


def own_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every node under ``node`` (a function's body, a lambda's expression, a loop, a
    module), not entering nested functions, lambdas or classes: they run at another
    time, with other names. A function's decorators and defaults are not its body.

    A function's list is kept on its node (``_own_nodes``) once walked: LF001 reads an
    autograd Function's methods a dozen times, and the list goes with the tree."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        found = node.__dict__.get("_own_nodes")
        if found is None:
            found = node.__dict__["_own_nodes"] = list(_own_nodes(node))
        return iter(found)
    return _own_nodes(node)


def _own_nodes(node: ast.AST) -> Iterator[ast.AST]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        stack: list[ast.AST] = list(reversed(node.body))
    elif isinstance(node, ast.Lambda):
        stack = [node.body]
    else:
        stack = children(node)[::-1]
    while stack:
        n = stack.pop()
        yield n
        if not isinstance(n, _SCOPES):
            stack.extend(children(n)[::-1])


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


def _walk_block(block: list[ast.stmt], scopes: bool = True) -> Iterator[ast.stmt]:
    """The statements of ``block``, nested blocks' in source order, without walking
    expressions (a tenth of the nodes); into function and class bodies unless ``scopes``
    is off. The one statement walk :func:`statements`, :func:`defined` and
    :func:`module_statements` share."""
    stack: list[ast.AST] = list(reversed(block))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.stmt):
            yield node
        if not scopes and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for name in _BLOCKS:
            inner = getattr(node, name, None)
            if inner:
                stack.extend(reversed(inner))


def statements(tree: ast.Module) -> Iterator[ast.stmt]:
    """Every statement of a file, nested ones included: imports, classes and functions
    are statements."""
    return _walk_block(tree.body)


def defined(block: list[ast.stmt]) -> Iterator[FunctionNode]:
    """Every function defined in ``block``, nested ones too, inner ones after outer: a
    ``def`` is a statement."""
    for node in _walk_block(block):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


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
        for child in children(node):
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
    "SymFloat SymBool Literal ProcessGroup Callable Enum type Type"
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
        if tail(ann.value) in ("Literal", "Callable", "Type", "type"):
            return True  # a class is never a tensor
        if tail(ann.value) not in _WRAPPERS:
            return False
        inner = ann.slice
        parts = inner.elts if isinstance(inner, ast.Tuple) else [inner]
        return all(plain_annotation(p) for p in parts)
    return False


#: generic containers whose arguments say what they hold (``List[Tensor]`` holds tensors)
_CONTAINERS = _WRAPPERS | words("Dict dict Mapping MutableMapping Deque deque Set set")


def tensor_annotation(ann: ast.AST | None) -> bool:
    """Does the annotation say the value is (or holds) tensors? ``Tensor``, a subclass
    named so (``LongTensor``, ``Sparse24Tensor``), a string of one, a union with one,
    and the standard containers of them (``Optional[Tensor]``, ``List[Tensor]``); not a
    class parametrized by a tensor type (``Request[Tensor]`` is a Request, whose fields
    say what it holds)."""
    if ann is None:
        return False
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        try:
            return tensor_annotation(ast.parse(ann.value, mode="eval").body)
        except SyntaxError:
            return False
    if isinstance(ann, (ast.Name, ast.Attribute)):
        return tail(ann).endswith("Tensor")
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        return tensor_annotation(ann.left) or tensor_annotation(ann.right)
    if isinstance(ann, ast.Subscript) and tail(ann.value) in _CONTAINERS:
        inner = ann.slice
        parts = inner.elts if isinstance(inner, ast.Tuple) else [inner]
        return any(tensor_annotation(p) for p in parts)
    return False


def annotated_class(ann: ast.AST | None) -> str | None:
    """The class an annotation names when it is neither a plain type nor a tensor nor a
    standard container: ``Request`` for ``Request[Tensor]``, ``All2AllInfo``,
    ``Optional[All2AllInfo]``; None otherwise."""
    if ann is None or plain_annotation(ann) or tensor_annotation(ann):
        return None
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        try:
            return annotated_class(ast.parse(ann.value, mode="eval").body)
        except SyntaxError:
            return None
    if isinstance(ann, ast.Subscript):
        if tail(ann.value) in ("Optional",):
            return annotated_class(ann.slice)
        return None if tail(ann.value) in _CONTAINERS else annotated_class(ann.value)
    if isinstance(ann, (ast.Name, ast.Attribute)):
        name = tail(ann)
        return name if name[:1].isupper() and name not in ("Any", "object") else None
    return None


def class_named(ann: ast.AST | None) -> str | None:
    """The class an annotation names, a tensor subclass included: ``Sparse24Tensor``,
    ``Optional[Request]``, ``Request[Tensor]``; None for plain types, ``torch.Tensor``
    itself and the standard containers."""
    if ann is None or plain_annotation(ann):
        return None
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        try:
            return class_named(ast.parse(ann.value, mode="eval").body)
        except SyntaxError:
            return None
    if isinstance(ann, ast.Subscript):
        if tail(ann.value) == "Optional":
            return class_named(ann.slice)
        return None if tail(ann.value) in _CONTAINERS else class_named(ann.value)
    if isinstance(ann, (ast.Name, ast.Attribute)):
        name = tail(ann)
        plain_tensor = name in ("Tensor", "LongTensor", "FloatTensor", "BoolTensor")
        return name if name[:1].isupper() and not plain_tensor and name != "Any" else None
    return None


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


#: a base's verdict: (is a Function, releases its ctx at run time), None when not one
Kind = tuple[bool, bool] | None


def module_statements(tree: ast.Module) -> Iterator[ast.stmt]:
    """The statements that run when the module is imported: its body, and the bodies of
    its ``if`` / ``try`` / ``with`` blocks (not functions or classes)."""
    return _walk_block(tree.body, scopes=False)


def bindings(tree: ast.Module, names: dict[str, str]) -> dict[str, list[str]]:
    """Every dotted name a module-level name may be bound to: ``BASE =
    torch.autograd.Function``, each branch of ``if flag: BASE = leakfree.Function`` /
    ``else: ...`` and of ``A if flag else B``, and each import of the name (``try: from
    leakfree import Function as BASE`` / ``except ImportError: from torch.autograd ...``).
    """
    out: dict[str, list[str]] = {}

    def bind(name: str, value: ast.AST) -> None:
        if isinstance(value, ast.IfExp):
            bind(name, value.body)
            bind(name, value.orelse)
            return
        full = resolve(value, names)
        if full is not None and full != name:
            out.setdefault(name, []).append(full)

    for node in module_statements(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                bind(target.id, node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            bind(node.target.id, node.value)
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node, "")  # relative bases were resolved by ``names``
            for a in node.names:
                local = a.asname or a.name
                full = names.get(local) if node.level else f"{base}.{a.name}"
                if full:
                    out.setdefault(local, []).append(full)
    return {k: list(dict.fromkeys(v)) for k, v in out.items()}


def function_classes(
    tree: ast.Module,
    names: dict[str, str],
    outside: Callable[[str], Kind] | None = None,
) -> list[FunctionClass]:
    """The autograd Function classes defined in ``tree`` (``names``: :func:`imports`).

    A base counts however it is spelled: through the file's imports or a module-level
    name bound to it (:func:`bindings`: an alias, a name chosen under ``if`` or by
    ``A if flag else B``), when it is PyTorch's Function, ``leakfree.Function`` (then
    ``releases`` is set), a class of this file that counts, or a class of another file
    of the scanned tree that counts (``outside``, given the dotted name: subclasses of
    subclasses across a package's imports). A name bound to several bases counts when
    any is a Function, and releases only when every one does. A base that resolves to
    none of these counts only with the shape of a Function: a static ``forward`` (or
    ``setup_context``) taking the ctx first, and a ``backward`` or ``vjp``, with a base
    named ``...Function`` or a first parameter named ``ctx``. That keeps
    ``sympy.Function`` and ``nn.Module`` subclasses out.
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
    bases = _Bases(classes, released, names, bindings(tree, names), outside)
    out = []
    for cls in classes.values():
        k = bases.kind(cls, frozenset())
        if k is None:
            continue
        methods: dict[str, FunctionNode] = {}
        for chain in reversed(_base_chain(cls, classes)):  # the class's own methods win
            methods.update(_own_methods(chain))
        out.append(FunctionClass(cls, k[1], methods))
    return out


@dataclass
class _Bases:
    """The verdict on each class of one file, base by base (:func:`function_classes`).

    An object, not closures: mutually recursive nested functions hold each other through
    their cells, a reference cycle that would keep the file's classes, and their syntax
    trees, alive until the cyclic collector runs, which the scan keeps off."""

    classes: dict[str, ast.ClassDef]
    released: set[str]
    names: dict[str, str]
    bound: dict[str, list[str]]
    outside: Callable[[str], Kind] | None
    memo: dict[str, Kind] = field(default_factory=dict)

    def kind(self, cls: ast.ClassDef, seen: frozenset[str]) -> Kind:
        if cls.name in self.memo:
            return self.memo[cls.name]
        self.memo[cls.name] = None  # a cycle of bases is no Function
        verdicts = [v for v in (self.base(b, cls, seen) for b in cls.bases) if v is not None]
        result: Kind = None
        if verdicts:
            result = (True, any(r for _, r in verdicts))
        if result is not None and cls.name in self.released:
            result = (True, True)
        self.memo[cls.name] = result
        return result

    def base(self, base: ast.expr, cls: ast.ClassDef, seen: frozenset[str]) -> Kind:
        if isinstance(base, ast.Name) and base.id in self.classes:
            candidates = [base.id]
        elif isinstance(base, ast.Name) and base.id in self.bound:
            candidates = self.bound[base.id]
        else:
            full = resolve(base, self.names)
            candidates = [full] if full is not None else []
        verdicts = [v for v in (self.named(c, cls, seen) for c in candidates) if v is not None]
        if verdicts:
            return (True, all(r for _, r in verdicts))
        if _has_shape(cls, tail(base).endswith("Function")):
            return (True, False)
        return None

    def named(self, full: str, cls: ast.ClassDef, seen: frozenset[str]) -> Kind:
        if full.startswith("leakfree.") and full.endswith("Function"):
            return (True, True)
        if full in AUTOGRAD_BASES:
            return (True, False)
        if full in self.classes and full not in seen:
            return self.kind(self.classes[full], seen | {cls.name})
        if self.outside is not None and "." in full and _may_be_function(cls):
            return self.outside(full)
        return None


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


def _may_be_function(cls: ast.ClassDef) -> bool:
    """Is the class worth reading another file for: does it define a static ``forward``,
    ``setup_context``, ``backward`` or ``vjp``? (A module's ``forward`` is a method: the
    thousands of ``nn.Module`` subclasses of a model zoo are never followed.)"""
    return any(
        is_static(fn)
        for name, fn in _own_methods(cls).items()
        if name in ("forward", "setup_context", "backward", "vjp")
    )


def _has_shape(cls: ast.ClassDef, function_named: bool) -> bool:
    m = _own_methods(cls)
    entry = m.get("setup_context") or m.get("forward")
    if entry is None or not is_static(entry) or not parameters(entry):
        return False
    if not ("backward" in m or "vjp" in m):
        return False
    return function_named or "ctx" in parameters(entry)[0].arg
