"""Which function a callable expression names, read from syntax: the pack hook handed to
``saved_tensors_hooks(pack, unpack)``, the helper a loop calls through a local alias.

:class:`Callables` resolves an expression to a :class:`Target` (the function, the file it
lies in, its enclosing scopes, and how many leading parameters ``functools.partial``
bound): a nested or module-level ``def`` of that name, a method reached through ``self``,
a lambda, ``partial(f, ...)``, the closure a factory call returns (``make_pack(...)``
whose body ends in ``return pack``), and across files the scanned tree's functions of
that name (:meth:`Project.helpers <leakfree.scan._model.Project.helpers>`).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from leakfree.scan._model import Project, Source
from leakfree.scan._syntax import (
    FunctionClass,
    FunctionNode,
    Kind,
    Scope,
    Scopes,
    function_classes,
    imports,
    own_nodes,
    parameters,
    plain_annotation,
    positional,
    tail,
    tensor_annotation,
)
from leakfree.scan._tensors import TensorEvidence


@dataclass(frozen=True)
class Target:
    """A function a callable expression names: ``params`` are the parameters a call's
    arguments fill (an instance's ``self`` and those ``partial`` bound left out), and
    ``bound`` the names ``partial`` bound (they live as long as the callable)."""

    source: Source
    fn: FunctionNode | ast.Lambda
    chain: tuple[Scope, ...]
    params: tuple[str, ...]
    bound: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        fn: FunctionNode | ast.Lambda,
        chain: tuple[Scope, ...],
        source: Source,
        skip_self: bool,
        bound: int = 0,
    ) -> Target:
        params = positional(fn)
        if skip_self and Scopes.is_method(fn, chain):
            params = params[1:]
        return cls(source, fn, chain, tuple(params[bound:]), tuple(params[:bound]))


def imported_names(project: Project, source: Source) -> dict[str, str]:
    """:func:`~leakfree.scan._syntax.imports` of ``source``, once per run."""
    return project.memo(
        "imports", source, source.tree, lambda: imports(source.tree, source.package)
    )


#: how many files a base class is followed through (``from .base import Fn`` re-exported
#: by a package's ``__init__``, defined in ``base.py`` as a subclass of another file's)
_BASE_DEPTH = 4


def autograd_classes(project: Project, source: Source) -> list[FunctionClass]:
    """The autograd Function classes ``source`` defines, decided once per run for every
    rule (:func:`~leakfree.scan._syntax.function_classes`); a base imported from another
    file of the scanned tree is read there."""
    return _classes(project, source, 0)


def _classes(project: Project, source: Source, depth: int) -> list[FunctionClass]:
    def outside(full: str) -> Kind:
        return _imported_kind(project, full, depth + 1)

    return project.memo(
        "autograd", source, source.tree,
        lambda: function_classes(source.tree, imported_names(project, source), outside),
    )  # fmt: skip


def _imported_kind(project: Project, full: str, depth: int) -> Kind:
    """Whether the class ``full`` (``pkg.base.MyFunction``) of another file of the scanned
    tree is an autograd Function: read where it is defined, or followed through the
    module that re-exports it."""
    if depth > _BASE_DEPTH:
        return None
    module, _, name = full.rpartition(".")
    other = project.module(module)
    if other is None:
        return None
    for fc in _classes(project, other, depth):
        if fc.node.name == name:
            return (True, fc.releases)
    again = imported_names(project, other).get(name)  # re-exported: follow it
    return _imported_kind(project, again, depth + 1) if again and again != full else None


class Callables:
    """Resolves callable expressions of one file, with each file's :class:`Scopes`
    computed once."""

    #: how many callees deep a verdict reads (``token_shift_fwd`` calls ``prepare_maxlens``,
    #: annotated ``-> int``)
    DEPTH = 2

    def __init__(self, source: Source, project: Project, depth: int = 0) -> None:
        self.source = source
        self.project = project
        self.depth = depth
        self._scopes: dict[int, Scopes] = {}
        self.scopes = self.scopes_of(source)

    def scopes_of(self, source: Source) -> Scopes:
        found = self._scopes.get(id(source.tree))
        if found is None:
            found = self._scopes[id(source.tree)] = Scopes(source.tree)
        return found

    def resolve(
        self, expr: ast.expr, chain: tuple[Scope, ...], depth: int = 0, bound: int = 0
    ) -> Target | None:
        """The function ``expr`` names, seen from a node enclosed by ``chain``."""
        if isinstance(expr, ast.Lambda):
            return Target.of(expr, self.scopes.chain(expr), self.source, False, bound)
        if isinstance(expr, ast.Name):
            fn = self.find_def(expr.id, chain)
            if fn is not None:
                return Target.of(fn, self.scopes.chain(fn), self.source, True, bound)
            for src, other in self.project.helpers(expr.id):
                if src is not self.source:
                    return Target.of(other, self.scopes_of(src).chain(other), src, True, bound)
            return None
        if isinstance(expr, ast.Call) and tail(expr.func) == "partial" and expr.args:
            if expr.keywords:
                return None
            # functools.partial(pack, a, b): the call fills the parameters not bound
            return self.resolve(expr.args[0], chain, depth, bound + len(expr.args) - 1)
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            cls = Scopes.class_of_self(expr.value.id, chain)
            if cls is None:
                return None
            for stmt in cls.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                    stmt.name == expr.attr
                ):
                    inner: tuple[Scope, ...] = (*self.scopes.chain(cls), cls)
                    return Target.of(stmt, inner, self.source, True, bound)
            return None
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and depth < 2:
            # a factory: ``make_pack(...)`` returning a nested ``def pack``
            factory = self.find_def(expr.func.id, chain)
            if factory is None:
                return None
            for node in own_nodes(factory):
                if isinstance(node, ast.Return) and node.value is not None:
                    enclosing: tuple[Scope, ...] = (*self.scopes.chain(factory), factory)
                    return self.resolve(node.value, enclosing, depth + 1)
        return None

    def find_def(self, name: str, chain: tuple[Scope, ...]) -> FunctionNode | None:
        """The ``def name`` visible from ``chain``: enclosing functions first, then the
        module (class bodies are not enclosing scopes)."""
        scopes: list[ast.AST] = [s for s in reversed(chain) if not isinstance(s, ast.ClassDef)]
        scopes.append(self.source.tree)
        for scope in scopes:
            for node in own_nodes(scope):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    return node
        return None


class ReturnReader:
    """What a call's callee returns, read where it is defined (this file first, else the
    one function of that name in the project), with the parameters that received tensors
    taken as tensors: none (its return annotation is a plain type, or no returned value
    holds one on its own evidence: ``_resolve_kv_heads(x, ...)`` returns ``x.shape[2] //
    n``, an int), a tensor (every return holds one: ``cast_to_fp8(x)`` returns
    ``x.to(fp8)``), or unknown. ``element`` asks about one position of the tuple it
    returns (``o, lse, ctx.scale = helper(q)``), read in every ``return a, b, c``."""

    #: how many callees deep a verdict reads (``token_shift_fwd`` calls ``prepare_maxlens``,
    #: annotated ``-> int``)
    DEPTH = 2

    def __init__(self, source: Source, project: Project, depth: int = 0) -> None:
        self.source = source
        self.project = project
        self.depth = depth
        #: (id of the callee, the parameters handed tensors, the element) -> the verdict:
        #: a call is judged many times while the caller's evidence reaches its fixpoint
        self._verdicts: dict[tuple[int, frozenset[str], int | None], bool | None] = {}
        self._readers: dict[str, ReturnReader] = {}

    def _inner(self, src: Source) -> ReturnReader:
        """The reader of the callees' own callees, one per file, its verdicts kept."""
        found = self._readers.get(src.path)
        if found is None:
            found = self._readers[src.path] = ReturnReader(src, self.project, self.depth + 1)
        return found

    def plain(self, call: ast.Call, caller: TensorEvidence, element: int | None = None) -> bool:
        """Does the callee return no tensor (at ``element``)?"""
        return self.returns(call, caller, element) is False

    def returns(
        self, call: ast.Call, caller: TensorEvidence, element: int | None = None
    ) -> bool | None:
        """True: the callee returns a tensor (at ``element``); False: none; None: the
        callee cannot be read (not found, several of that name) or it depends."""
        if not isinstance(call.func, ast.Name):
            return None
        name = call.func.id
        local = self.project.defs(self.source).get(name, [])
        found = [(self.source, fn) for fn in local] or list(self.project.helpers(name))
        if len(found) != 1:
            return None  # not found, or several of that name: the name decides nothing
        src, fn = found[0]
        if plain_annotation(fn.returns):
            return False
        params = [p.arg for p in parameters(fn)]
        seed = {
            params[i]
            for i, a in enumerate(call.args)
            if i < len(params) and not isinstance(a, ast.Starred) and caller.holds(a)
        }
        key = (id(fn), frozenset(seed), element)
        if key not in self._verdicts:
            names = imported_names(self.project, src)
            inner = self._inner(src).returns if self.depth + 1 < self.DEPTH else None
            evidence = TensorEvidence(
                fn, names, set(), seed=seed, inputs=False, returned=False, callee=inner
            )
            whole = [n.value for n in own_nodes(fn) if isinstance(n, ast.Return) and n.value]
            returns = whole if element is None else [_element(r, element) for r in whole]
            known = [r for r in returns if r is not None]
            verdict: bool | None = None
            if known and len(known) == len(returns):
                held = [evidence.holds(r) for r in known]
                verdict = True if all(held) else False if not any(held) else None
                if verdict and element is not None and any(_container(r, fn) for r in known):
                    # ``return args, dict(zip(names, values))``: a dict that may hold the
                    # inputs says nothing of what each key holds (``kwargs["eps"]``)
                    verdict = None
            if verdict is None:
                # the body cannot say (it returns other helpers' results): the return
                # annotation may (Liger's ``-> tuple[torch.Tensor, torch.Tensor, ...]``);
                # read after the body, which wins where they disagree (fla's ``->
                # torch.Tensor`` over a four-tuple)
                verdict = _annotated(fn.returns, element)
            self._verdicts[key] = verdict
        return self._verdicts[key]


_CONTAINER_CALLS = frozenset({"dict", "list", "tuple", "set", "zip", "sorted", "OrderedDict"})
_DISPLAYS = (ast.Dict, ast.List, ast.Tuple, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)


def _container(value: ast.expr, fn: FunctionNode) -> bool:
    """Is ``value`` a container display, a container built by a builtin, or a name ``fn``
    binds only to those?"""
    if isinstance(value, _DISPLAYS):
        return True
    if isinstance(value, ast.Call):
        return tail(value.func) in _CONTAINER_CALLS
    if isinstance(value, ast.Name):
        bound = [
            n.value
            for n in own_nodes(fn)
            if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == value.id for t in n.targets)
        ]
        return bool(bound) and all(
            isinstance(b, ast.expr) and not isinstance(b, ast.Name) and _container(b, fn)
            for b in bound
        )
    return False


def _element(value: ast.expr, i: int) -> ast.expr | None:
    """The ``i``-th of a returned tuple display (``return o, lse, scale``), else None."""
    if isinstance(value, (ast.Tuple, ast.List)) and not any(
        isinstance(e, ast.Starred) for e in value.elts
    ):
        return value.elts[i] if i < len(value.elts) else None
    return None


def _annotated(ann: ast.expr | None, element: int | None) -> bool | None:
    """What a return annotation says of the result (at ``element`` of a ``tuple[...]``):
    False a plain type, True a tensor, None nothing."""
    if ann is None:
        return None
    if (
        element is not None
        and isinstance(ann, ast.Subscript)
        and tail(ann.value)
        in (
            "tuple",
            "Tuple",
        )
    ):
        parts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
        if any(isinstance(p, ast.Constant) and p.value is Ellipsis for p in parts):
            parts = parts[:1] * (element + 1)  # tuple[Tensor, ...]
        if element < len(parts):
            ann = parts[element]
    if plain_annotation(ann):
        return False
    return True if tensor_annotation(ann) else None
