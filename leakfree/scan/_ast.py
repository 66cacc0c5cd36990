"""Shared :mod:`ast` helpers for the rules: names, imports, autograd Function classes, and a
small "can this value hold tensors?" inference.

Everything here reads syntax only; nothing is imported or evaluated. The inference is
deliberately one-sided: it answers *yes* only on evidence (a ``torch`` call, a tensor
method, a name the code itself treats as a tensor...) and *no* otherwise, so a rule built
on it stays quiet on values it cannot see into.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from leakfree.scan._model import FunctionNode

__all__ = [
    "FunctionClass",
    "TensorEvidence",
    "aliases_of",
    "dotted",
    "elements",
    "function_classes",
    "imports",
    "metadata_named",
    "own_nodes",
    "parameters",
    "words",
]


def words(text: str) -> frozenset[str]:
    """A set of names written as one space-separated string (long tables stay compact)."""
    return frozenset(text.split())


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


def imports(tree: ast.Module, module: str = "") -> dict[str, str]:
    """Local name -> the dotted name it was imported as (module level and nested imports;
    relative imports resolved against ``module``, the file's own dotted name)."""
    out: dict[str, str] = {}
    package = module.rsplit(".", 1)[0] if "." in module else ""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = a.name
                else:
                    head = a.name.split(".", 1)[0]
                    out[head] = head
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
                base = ".".join([*parts, base] if base else parts)
            for a in node.names:
                out[a.asname or a.name] = f"{base}.{a.name}" if base else a.name
    return out


def resolve(node: ast.AST, names: dict[str, str]) -> str | None:
    """The dotted name of ``node`` with its first part replaced by what it was imported as."""
    d = dotted(node)
    if d is None:
        return None
    head, _, rest = d.partition(".")
    full = names.get(head, head)
    return f"{full}.{rest}" if rest else full


def parameters(fn: FunctionNode) -> list[ast.arg]:
    """Positional parameters in order (positional-only first), then keyword-only."""
    a = fn.args
    return [*a.posonlyargs, *a.args, *a.kwonlyargs]


def own_nodes(fn: FunctionNode) -> Iterator[ast.AST]:
    """Every node in ``fn``'s body, not descending into nested functions, lambdas or
    classes (they run at another time, with other names)."""
    stack: list[ast.AST] = list(reversed(fn.body))
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
            ):
                stack.append(child)


def aliases_of(fn: FunctionNode, name: str) -> set[str]:
    """``name`` and the plain names assigned from it (``c = ctx``), transitively."""
    found = {name}
    assigns = [
        n for n in own_nodes(fn) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name)
    ]
    changed = True
    while changed:
        changed = False
        for n in assigns:
            if isinstance(n.value, ast.Name) and n.value.id in found:
                for t in n.targets:
                    if isinstance(t, ast.Name) and t.id not in found:
                        found.add(t.id)
                        changed = True
    return found


# --- autograd Function classes ------------------------------------------------------------

#: dotted names of PyTorch's Function base classes
AUTOGRAD_BASES = words(
    "torch.autograd.Function torch.autograd.function.Function "
    "torch.autograd.function.InplaceFunction torch.autograd.function._SingleLevelFunction"
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


def _is_static(fn: FunctionNode) -> bool:
    return any(dotted(d) in ("staticmethod", "classmethod") for d in fn.decorator_list)


def _own_methods(cls: ast.ClassDef) -> dict[str, FunctionNode]:
    return {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def function_classes(
    tree: ast.Module, module: str = "", names: dict[str, str] | None = None
) -> list[FunctionClass]:
    """The autograd Function classes defined in ``tree``.

    A base counts when it resolves (through the file's imports) to PyTorch's Function, to
    ``leakfree.Function`` (then ``releases`` is set), or to a class of this file that
    counts. A base of another name ending in ``Function`` (a project's own base, or an
    unresolved ``Function``) counts only with the shape of one: a static ``forward`` (or
    ``setup_context``) whose first parameter is the ctx, and a ``backward`` or ``vjp``.
    That keeps ``sympy.Function`` and similar out. ``names`` is :func:`imports`'s result
    when the caller already has it.
    """
    if names is None:
        names = imports(tree, module)
    classes: dict[str, ast.ClassDef] = {}
    released: set[str] = set()  # classes handed to release_after_backward
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            classes.setdefault(node.name, node)
            for d in node.decorator_list:
                f = resolve(d.func if isinstance(d, ast.Call) else d, names) or ""
                if f.rsplit(".", 1)[-1] == "release_after_backward":
                    released.add(node.name)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Name):
            f = resolve(node.func, names) or ""
            if f.rsplit(".", 1)[-1] == "release_after_backward":
                released.add(node.args[0].id)
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
            elif full in AUTOGRAD_BASES or full in ("autograd.Function", "function.Function"):
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
        # same-file bases first, so the class's own methods win
        for chain in reversed(_base_chain(cls, classes)):
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
        and _is_static(entry)
        and bool(parameters(entry))
        and ("backward" in m or "vjp" in m)
    )


# --- can a value hold tensors? --------------------------------------------------------------

#: calls that add their (last) argument to the container they are called on
_ADDERS = frozenset({"append", "extend", "add", "insert", "appendleft"})
#: attributes of a tensor that are plain metadata
META_ATTRS = words(
    "shape dtype device ndim requires_grad is_cuda is_leaf layout is_sparse is_quantized "
    "is_meta names itemsize nbytes is_nested _version is_cpu is_mps is_xpu"
)
#: methods of a tensor that return metadata (numbers, bools, sizes, strings)
META_METHODS = words(
    "size dim numel stride item tolist data_ptr is_contiguous element_size get_device "
    "nelement storage_offset is_floating_point is_complex ndimension is_pinned is_shared "
    "is_set_to __len__ is_signed is_inference type"
)
#: attribute uses that only a tensor (or a tensor-like storage object) has
TENSOR_USES = words(
    "view reshape contiguous numel requires_grad data_ptr transpose is_contiguous stride "
    "is_cuda element_size new_empty new_zeros new_ones new_full narrow unsqueeze squeeze "
    "expand permute detach requires_grad_ untyped_storage masked_fill matmul mm bmm "
    "view_as expand_as reshape_as copy_ zero_ fill_ add_ mul_ grad_fn _base storage clone "
    "T mT"
)
#: builtins whose result holds no tensor, whatever they are given
META_BUILTINS = words(
    "len isinstance issubclass int float bool str type id hash repr range hasattr "
    "callable getattr format abs round object super print any all ord chr bytes frozenset"
)
#: builtins that build containers of their arguments' elements
CONTAINER_BUILTINS = words(
    "list tuple set dict sorted reversed zip enumerate iter next max min map filter"
)
#: modules whose functions return tensors (except the metadata ones below)
TORCH_TENSOR_MODULES = words(
    "torch torch.nn.functional torch.linalg torch.fft torch.special torch.sparse "
    "torch.nested torch._C._nn torch._C._VariableFunctions"
)
_TORCH_META_PREFIXES = (
    "is_",
    "get_default",
    "get_autocast",
    "current_",
    "set_",
    "device",
    "get_device",
    "default_",
    "_is",
    "are_",
    "use_",
    "compiled_with",
    "get_num",
    "typename",
)
_TORCH_META = words(
    "dtype Size finfo iinfo result_type promote_types numel equal no_grad enable_grad "
    "inference_mode Generator Stream Event stream autocast empty_cache manual_seed seed "
    "initial_seed can_cast sym_int sym_float sym_max sym_min broadcast_shapes"
)


#: attributes of a tensor (or of a storage object) that are tensors
TENSOR_ATTRS = frozenset({"T", "mT", "H", "mH", "data", "grad", "real", "imag", "_base"})


def _tensor_attr(name: str) -> bool:
    if "meta" in name:
        return False  # _metadata_cache, fp8_meta: bookkeeping beside the data
    return name in TENSOR_ATTRS or "data" in name or "tensor" in name


#: torch functions whose positional arguments are sizes or data, not tensors
_FACTORIES = words(
    "zeros ones empty full arange range tensor as_tensor rand randn randint randperm "
    "linspace logspace eye from_numpy empty_strided scalar_tensor frombuffer asarray "
    "normal bernoulli"
)


def _torch_call_makes_tensor(full: str) -> bool:
    mod, _, fn = full.rpartition(".")
    if fn == "get_rng_state":
        return True  # torch.get_rng_state / torch.cuda.get_rng_state: a state tensor
    if not (mod in TORCH_TENSOR_MODULES or mod.startswith("torch.ops.")):
        return False
    return not (fn in _TORCH_META or fn.startswith(_TORCH_META_PREFIXES) or fn[:1].isupper())


class TensorEvidence:
    """Which local names of a function hold tensors, on evidence in the function itself.

    A name holds tensors when the code shows it: it is annotated ``Tensor``; it is passed
    to ``ctx.save_for_backward`` / ``mark_dirty`` / ``save_for_forward``, or first to a
    ``torch`` function (alone or in arithmetic of names: ``torch.round(a / b)``); it is
    used with a tensor-only attribute (``x.view(...)``, ``x.clone()``, ``x.T``...; not
    ``.shape`` or ``.dtype``, which quantization states and specs have too); it is
    returned by ``forward``; or it is assigned (or appended, extended, stored into) from an
    expression that holds tensors: a ``torch`` function call (bar metadata queries), a
    tensor method or attribute (bar ``.shape``, ``.size()``, ``.item()``...), arithmetic,
    indexing or a container of such values, a loop or comprehension over them (a branch
    guarded by ``torch.is_tensor`` / ``isinstance(..., Tensor)`` is judged by its guard),
    or a call of any other function that is handed one (its result may keep it). Tuple
    targets of a call whose other element is spread into ``save_for_backward(*tensors)``
    hold tensors too (the ``tensors, objects = prepare_for_saving(...)`` split). Nothing
    else does: a parameter only passed through, a ``self.`` attribute, a constructor
    without tensor arguments, a parameter the function writes tensors into (the caller's
    object).
    """

    def __init__(self, fn: FunctionNode, names: dict[str, str], ctx: set[str]) -> None:
        self.names = names
        self.ctx = ctx
        self.tensors: set[str] = set()
        nodes = list(own_nodes(fn))
        params = parameters(fn)
        va = fn.args.vararg
        for p in params + ([va] if va else []):
            if p.arg in ctx:
                continue
            ann = ast.unparse(p.annotation) if p.annotation is not None else ""
            if "Tensor" in ann and "Optional[int" not in ann:
                self.tensors.add(p.arg)
        saved = {  # first, as the split rule below needs it whatever the statement order
            v.id
            for n in nodes
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name)
            and n.func.value.id in ctx
            and n.func.attr in ("save_for_backward", "mark_dirty", "save_for_forward")
            for a in n.args
            if isinstance(v := (a.value if isinstance(a, ast.Starred) else a), ast.Name)
        }
        # ``save_for_backward(*tensors)``: a list built to be saved, maybe split from others
        spread = {
            a.value.id
            for n in nodes
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "save_for_backward"
            for a in n.args
            if isinstance(a, ast.Starred) and isinstance(a.value, ast.Name)
        }
        # (target, value, whether a call handed a tensor counts): ``a, b = f(x)`` splits a
        # result of unknown make-up (strides, a dtype...), so only strong evidence counts
        flows: list[tuple[ast.AST, ast.AST, bool]] = []
        params_ = {p.arg for p in params} | ({va.arg} if va else set())
        for n in nodes:
            if (
                isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name)
                and n.attr in TENSOR_USES
                and n.value.id not in ctx
            ):
                self.tensors.add(n.value.id)
            if isinstance(n, ast.Call):
                # a name handed to a torch function (torch.matmul(a, b), F.linear(x, w))
                full = resolve(n.func, names)
                if (
                    full is not None
                    and full.startswith("torch.")
                    and _torch_call_makes_tensor(full)
                    and full.rsplit(".", 1)[-1] not in _FACTORIES
                ):
                    # the first argument only: later ones are often sizes, dims or split
                    # lists (torch.split(x, m_splits))
                    for v in _operands(n.args[0]) if n.args else ():
                        if v.id not in ctx:
                            self.tensors.add(v.id)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                if n.func.attr in _ADDERS and n.args:
                    flows.append((n.func.value, n.args[-1], True))
            elif isinstance(n, ast.Return) and n.value is not None and fn.name == "forward":
                for r in elements(n.value):
                    if isinstance(r, ast.Name) and r.id not in ctx:
                        self.tensors.add(r.id)
            elif isinstance(n, ast.Assign):
                for t in n.targets:
                    flows.extend(_pairs(t, n.value, True))
                    if isinstance(t, ast.Tuple) and isinstance(n.value, ast.Call):
                        elts = [e.value if isinstance(e, ast.Starred) else e for e in t.elts]
                        if any(isinstance(e, ast.Name) and e.id in spread for e in elts):
                            self.tensors.update(e.id for e in elts if isinstance(e, ast.Name))
            elif isinstance(n, (ast.AnnAssign, ast.AugAssign)) and n.value is not None:
                flows.append((n.target, n.value, True))
            elif isinstance(n, (ast.For, ast.AsyncFor)):
                flows.extend(_pairs(n.target, ast.Subscript(n.iter, ast.Constant(0)), True))
            elif isinstance(n, ast.NamedExpr):
                flows.append((n.target, n.value, True))
            elif isinstance(n, (ast.With, ast.AsyncWith)):
                for item in n.items:
                    if item.optional_vars is not None:
                        flows.append((item.optional_vars, item.context_expr, True))
        self.tensors |= saved
        changed = True
        while changed:  # a fixpoint over the function's assignments: a few passes at most
            changed = False
            for target, value, weak in flows:
                base = _root_name(target)
                if base is None or base in self.tensors or base in ctx:
                    continue
                if base in params_ and not isinstance(target, ast.Name):
                    continue  # p.x = t / p[k] = t: the caller's object, not this call's state
                if self.holds(value, weak=weak):
                    self.tensors.add(base)
                    changed = True

    def holds(self, e: ast.AST, local: frozenset[str] = frozenset(), weak: bool = True) -> bool:
        """Can ``e`` hold a tensor, on the evidence gathered? With ``weak`` off, a call
        counts only as a ``torch`` function or a tensor method, not as any call handed a
        tensor."""
        h = self.holds
        if isinstance(e, ast.Name):
            return e.id in self.tensors or e.id in local
        if isinstance(e, ast.Attribute):
            # x.T, x.grad, storage._data: tensors; any other attribute of a tensor-like
            # object (x._spec, q.layout) is taken as metadata
            return _tensor_attr(e.attr) and h(e.value, local)
        if isinstance(e, ast.Subscript):
            return h(e.value, local)
        if isinstance(e, (ast.Starred, ast.NamedExpr, ast.Await)):
            return h(e.value, local)
        if isinstance(e, ast.BinOp):
            return h(e.left, local) or h(e.right, local)
        if isinstance(e, ast.UnaryOp):
            return not isinstance(e.op, ast.Not) and h(e.operand, local)
        if isinstance(e, ast.BoolOp):
            return any(h(v, local) for v in e.values)
        if isinstance(e, ast.IfExp):
            # ``a if not torch.is_tensor(a) else None``: the test says which branch is not
            guard = _tensor_test(e.test)
            if guard is not None:
                return h(e.body if guard else e.orelse, local)
            return h(e.body, local) or h(e.orelse, local)
        if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
            return any(h(v, local) for v in e.elts)
        if isinstance(e, ast.Dict):
            return any(h(v, local) for v in e.values)
        if isinstance(e, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            inner = set(local)
            for g in e.generators:
                if h(g.iter, frozenset(inner)):
                    inner.update(_target_names(g.target))
            fl = frozenset(inner)
            if isinstance(e, ast.DictComp):
                return h(e.value, fl)
            return h(e.elt, fl)
        if isinstance(e, ast.Call):
            return self._call_holds(e, local, weak)
        return False

    def _call_holds(self, e: ast.Call, local: frozenset[str], weak: bool) -> bool:
        func = e.func
        args = [*e.args, *(k.value for k in e.keywords)]
        if isinstance(func, ast.Attribute):
            if func.attr in META_METHODS or func.attr.startswith("__"):
                return False
            if func.attr == "get_rng_state":
                return True
            full = resolve(func, self.names)
            if full is not None and full.split(".", 1)[0] == "torch":
                return _torch_call_makes_tensor(full)
            if self.holds(func.value, local):
                return True  # a tensor method (or a container's .copy()/.pop())
        elif isinstance(func, ast.Name):
            if func.id in META_BUILTINS:
                return False
            if func.id in CONTAINER_BUILTINS:
                return any(self.holds(a, local) for a in args)
            full = self.names.get(func.id, func.id)
            if full.startswith("torch."):
                return _torch_call_makes_tensor(full)
        # any other call: its result may keep what it was handed
        return weak and any(self.holds(a, local) for a in args)


#: words that name metadata (``ctx.grad_shape``, ``s_dtype``, ``index_strides``)
META_WORDS = words(
    "dtype dtypes shape shapes size sizes stride strides layout layouts spec specs ndim "
    "dims numel device devices len lens length lengths rank ranks world mode flag flags "
    "kind config cfg dtype_a offsets_meta sig signature"
)


#: words that name tensors, for the elements of ``a, b = f(x)`` (see :func:`_pairs`)
TENSOR_WORDS = words("tensor tensors args inputs outputs activations buffers grads")


def _words(name: str) -> list[str]:
    return [w for w in name.lower().split("_") if w]


def metadata_named(attr: str, value: ast.AST) -> bool:
    """Does the attribute, or every name the value is made of, name metadata?

    ``ctx.grad_shape = ...``, ``ctx.dtypes = s_dtype, t_dtype``: a name that says shape,
    dtype, stride, layout, spec, device, rank, mode... is taken at its word.
    """
    if any(w in META_WORDS for w in _words(attr)):
        return True
    names = [v for v in elements(value)]
    return bool(names) and all(
        isinstance(v, ast.Name) and any(w in META_WORDS for w in _words(v.id)) for v in names
    )


def _tensor_test(test: ast.AST) -> bool | None:
    """True for ``is_tensor(x)`` / ``isinstance(x, ...Tensor)``, False for their negation,
    None for any other test."""
    negated = False
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        negated, test = not negated, test.operand
    if not isinstance(test, ast.Call):
        return None
    name = dotted(test.func) or ""
    last = name.rsplit(".", 1)[-1]
    if last == "is_tensor" or (
        last == "isinstance" and len(test.args) == 2 and "Tensor" in ast.unparse(test.args[1])
    ):
        return not negated
    return None


def _operands(e: ast.AST) -> list[ast.Name]:
    """The names ``e`` is, or is arithmetic of names only (``a``, ``a / b``, ``-a``); in
    ``f(x) * n - shift`` the plain names may be numbers scaling a tensor."""
    if isinstance(e, ast.Name):
        return [e]
    if isinstance(e, ast.BinOp):
        left, right = _operands(e.left), _operands(e.right)
        return left + right if left and right else []
    if isinstance(e, ast.UnaryOp) and not isinstance(e.op, ast.Not):
        return _operands(e.operand)
    return []


def elements(e: ast.AST) -> Iterator[ast.AST]:
    """The leaves of a tuple / list display (``a, (b, *c)``: a, b, c); anything else is
    its own one element."""
    if isinstance(e, (ast.Tuple, ast.List)):
        for v in e.elts:
            yield from elements(v.value if isinstance(v, ast.Starred) else v)
    else:
        yield e


def _pairs(target: ast.AST, value: ast.AST, weak: bool) -> Iterable[tuple[ast.AST, ast.AST, bool]]:
    """Split ``a, b = x, y`` into element pairs where the shapes match; the elements of
    ``a, b = f(...)`` get the whole value, with weak evidence off."""
    if (
        isinstance(target, (ast.Tuple, ast.List))
        and isinstance(value, (ast.Tuple, ast.List))
        and len(target.elts) == len(value.elts)
        and not any(isinstance(v, ast.Starred) for v in [*target.elts, *value.elts])
    ):
        for t, v in zip(target.elts, value.elts):
            yield from _pairs(t, v, weak)
    elif isinstance(target, (ast.Tuple, ast.List)):
        for t in target.elts:
            t = t.value if isinstance(t, ast.Starred) else t
            # ``expanded_args, kwargs = f(x)``: an element named for tensors keeps weak
            # evidence; ``mask, dropout = f(x)`` does not
            named = isinstance(t, ast.Name) and any(w in TENSOR_WORDS for w in _words(t.id))
            yield t, value, weak and named
    else:
        yield target, value, weak


def _root_name(t: ast.AST) -> str | None:
    """The variable an assignment target writes into (``x``, ``x[i]``, ``x.attr`` -> x)."""
    while isinstance(t, (ast.Subscript, ast.Attribute, ast.Starred)):
        t = t.value
    return t.id if isinstance(t, ast.Name) else None


def _target_names(t: ast.AST) -> Iterator[str]:
    for n in ast.walk(t):
        if isinstance(n, ast.Name):
            yield n.id
