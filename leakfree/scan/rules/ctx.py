"""LF001 and LF002: state a custom autograd Function parks on ``ctx``.

**LF001, ctx state that outlives backward.** Autograd frees what ``ctx.save_for_backward``
saved once the node's backward has run, but never touches plain attributes: ``ctx`` is the
backward node, and it lives as long as anything references the graph (a logged loss, an
output kept for the next step). Transformer Engine's ``func_ctx.tensor_objects`` pinned
FP8 buffers this way from 2.0 to 2.14::

    class _OperationFuserAutogradFunction(torch.autograd.Function):
        @staticmethod
        def forward(func_ctx, x, fuser, *params):
            tensors, objects = prepare_for_saving(*to_save)
            func_ctx.save_for_backward(*tensors)
            func_ctx.tensor_objects = objects          # <- LF001
        @staticmethod
        def backward(func_ctx, dy):
            saved = restore_from_saved(func_ctx.tensor_objects, func_ctx.saved_tensors)
            # fixed in 2.14: func_ctx.tensor_objects = None

**LF002, an output stored on ctx.** ``ctx.out = out; return out``: the output's
``grad_fn`` is ``ctx``, so output -> ctx -> output is a reference cycle; for a view of the
output even the cyclic collector cannot free it. ``leakfree.Function`` raises
``ReferenceCycleError`` for it at run time.

What counts, decided from the code only (see :mod:`leakfree.scan._ast`):

- **A Function**: a class whose base resolves through the file's imports to
  ``torch.autograd.Function`` (or ``InplaceFunction``), or to a same-file class that is
  one; a base of another name ending in ``Function`` only when the class has the shape (a
  static ``forward``/``setup_context`` taking ctx first, and a ``backward``/``vjp``).
  ``leakfree.Function`` subclasses, and classes the file hands to
  ``release_after_backward``, release their ctx at run time: LF001 is quiet for them,
  LF002 is not (the cycle forms before any backward).
- **The ctx**: the first parameter of ``setup_context`` when the class defines one, else
  of ``forward``, whatever its spelling (``ctx``, ``func_ctx``, ``context``), and plain
  names assigned from it (``c = ctx``). Stores counted: ``ctx.a = v`` (also in tuple
  targets, annotated and augmented), ``setattr(ctx, "a", v)``, ``ctx.a[k] = v`` and
  ``ctx.a.append(v)`` / ``extend`` / ``add`` / ``insert``.
- **Can hold tensors** (LF001): the stored value holds tensors on evidence in the same
  function (:class:`~leakfree.scan._ast.TensorEvidence`): a ``torch`` call, a tensor
  method or attribute, a name used as a tensor or passed to ``save_for_backward``, a
  returned name, a container or arithmetic of those, a call handed one, the other half of a
  ``tensors, objects = split(...)`` whose first half is spread into
  ``save_for_backward(*tensors)``. Anything without evidence is taken as metadata and
  stays quiet: literals, ``.shape`` / ``.dtype`` / ``.size()`` / ``len()`` /
  ``isinstance()``, parameters only passed through (quantizers, recipes, process groups,
  modules, callables), ``self.`` attributes, constructor calls without tensor arguments,
  the elements of ``a, b = helper(x)`` unless named for tensors, and attributes or values
  whose name says metadata (``grad_shape``, ``s_dtype``, ``index_strides``).
- **Released on the backward path** (LF001): ``backward`` or ``vjp`` (the class's or a
  same-file base's) sets the attribute to ``None`` or another constant or empty container,
  deletes it (``del ctx.a``, ``delattr``), clears it (``ctx.a.clear()``), clears the whole
  ctx (``ctx.__dict__.clear()``, ``setattr``/``delattr`` with a computed name), or passes
  ctx to a function of the scanned tree that does one of these to its parameter, or
  passes ``ctx.a`` to a plain-named one that clears it (followed by name through
  :meth:`Project.helpers`, four calls deep; any same-named function that releases
  counts; ``torch.matmul(g, ctx.w)`` and methods are not followed for ``ctx.a``). A
  release on any branch counts: the rule does not judge control flow.
- **An output** (LF002): a name ``forward`` returns (not a parameter passed back through,
  which autograd wraps in a new view, unless it was ``mark_dirty``-ed; not a name passed to
  ``mark_non_differentiable``, nor one named as an index, id map or mask, ``row_id_map``:
  integer and boolean outputs get no ``grad_fn``); ``setup_context``'s third
  parameter and names unpacked from it; a ``ctx.a`` that ``forward`` returns; and views of
  these (``.view``, ``.reshape``, ``[...]``, ``.transpose``, ``.t()``, ``.T``...), also
  inside a tuple, list or dict. A ``.detach()``-ed output makes no cycle (it has no
  ``grad_fn``): it is LF001's business if never released.

One finding per class and attribute, at the first store that qualifies; an attribute LF002
reports is not reported again by LF001.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from leakfree.scan._flow import Flow, TensorEvidence, handle_named, metadata_named
from leakfree.scan._model import NOTE, Finding, Project, Rule, Source
from leakfree.scan._syntax import (
    FunctionClass,
    FunctionNode,
    elements,
    function_classes,
    imports,
    name_words,
    own_nodes,
    parameters,
    plain_annotation,
    tail,
    words,
)

__all__ = ["RULES"]

_CONFIRM_LF001 = (
    "leakfree.diagnostics.find_retained (lists what each graph's ctx still holds after "
    "backward); leakfree.testing.assert_no_leak around one step"
)
_CONFIRM_LF002 = (
    "subclass leakfree.Function (raises ReferenceCycleError naming the attribute); "
    "leakfree.testing.assert_no_leak with gc disabled"
)
#: calls that add their (last) argument to the container they are called on
_ADDERS = frozenset({"append", "extend", "add", "insert", "appendleft", "update", "setdefault"})
#: methods and attributes of a tensor that return a view of it (share its ``_base``)
_VIEWS = words(
    "view view_as reshape reshape_as transpose t permute narrow select unsqueeze squeeze "
    "expand expand_as flatten unflatten split chunk unbind tensor_split movedim swapaxes "
    "diagonal as_strided unfold real imag T mT H mH contiguous"
)
_MAX_DEPTH = 4
#: words naming integer or boolean outputs, which never get a grad_fn (no cycle)
_INDEX_WORDS = words("idx index indices ids id map mask masks count counts argmax argmin")


@dataclass(frozen=True)
class _Store:
    attr: str
    value: ast.AST
    node: ast.AST
    #: names an enclosing ``if torch.is_tensor(x)`` proves hold no tensor here
    not_tensors: frozenset[str] = frozenset()


def _stores(fn: FunctionNode, flow: Flow, ctx: set[str]) -> Iterator[_Store]:
    """Every value ``fn`` puts into a ctx attribute (``ctx.a = v``, ``ctx.a[k] = v``,
    ``ctx.a.append(v)``..., ``setattr(ctx, "a", v)``), in source order."""
    for step in flow.steps:
        target = step.target.value if isinstance(step.target, ast.Subscript) else step.target
        attr = _ctx_attr(target, ctx)
        if attr is not None and (step.how in _ADDERS or step.how in ("=", "+=")):
            yield _Store(attr, step.value, step.node, step.not_tensors)
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
            yield _Store(n.args[1].value, n.args[2], n)


def _ctx_attr(e: ast.AST, ctx: set[str]) -> str | None:
    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id in ctx:
        return e.attr
    return None


# --- what the backward path releases -----------------------------------------------------

_ALL = "*"  # the whole ctx is released


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


class _Releases:
    """Which ctx attributes a function releases, following calls into the scanned tree."""

    def __init__(self, project: Project, names: dict[str, str]) -> None:
        self.project = project
        self.names = names  # the scanned file's imports
        self.memo: dict[tuple[int, str], frozenset[str]] = {}
        self.clears: dict[tuple[int, str], bool] = {}

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
                        a = _ctx_attr(e, ctx)
                        if a is not None:
                            out.add(a)
            elif isinstance(n, ast.Assign) and isinstance(n.value, ast.Tuple):
                for t in n.targets:  # ctx.a, ctx.b = None, None
                    if isinstance(t, ast.Tuple) and len(t.elts) == len(n.value.elts):
                        for e, v in zip(t.elts, n.value.elts):
                            a = _ctx_attr(e, ctx)
                            if a is not None and _is_empty(v):
                                out.add(a)
            elif isinstance(n, ast.Delete):
                for t in n.targets:
                    a = _ctx_attr(t, ctx)
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
                    out.add(_ALL)  # a loop over names: take it as releasing everything
            return out
        if isinstance(f, ast.Attribute):
            recv = f.value
            if f.attr in ("clear", "pop", "popitem"):
                held = _ctx_attr(recv, ctx)
                if held == "__dict__" or (
                    isinstance(recv, ast.Call)
                    and isinstance(recv.func, ast.Name)
                    and recv.func.id == "vars"
                    and recv.args
                    and isinstance(recv.args[0], ast.Name)
                    and recv.args[0].id in ctx
                ):
                    if f.attr == "clear":
                        out.add(_ALL)
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
        # which arguments are the ctx, or a ctx attribute?
        passed: list[tuple[int | str, str | None]] = []
        # ctx.a handed on is followed only into a plain-named helper of this project
        # (``_drop(ctx.buffers)``), not into ``torch.matmul(g, ctx.w)`` or ``x.mul(ctx.s)``
        attrs_too = isinstance(f, ast.Name) and not self.names.get(f.id, "").startswith("torch")
        for i, arg in enumerate(n.args):
            if isinstance(arg, ast.Name) and arg.id in ctx:
                passed.append((i, None))
            elif attrs_too and (attr := _ctx_attr(arg, ctx)) is not None:
                passed.append((i, attr))
        for k in n.keywords:
            if k.arg is None:
                continue
            if isinstance(k.value, ast.Name) and k.value.id in ctx:
                passed.append((k.arg, None))
            elif attrs_too and (attr := _ctx_attr(k.value, ctx)) is not None:
                passed.append((k.arg, attr))
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


# --- outputs -----------------------------------------------------------------------------

#: words naming integer or boolean outputs (indices, id maps, masks, counts): tensors that
#: never get a grad_fn, so storing them makes no cycle
_INDEX_WORDS = words("idx index indices ids id map mask masks count counts argmax argmin")
#: calls whose result is a tuple or list of tensors: as one element of forward's result it
#: is not a tensor output and gets no grad_fn
_SEQUENCES = words("chunk split unbind tensor_split hsplit vsplit dsplit list tuple")


def _outputs(
    fn: FunctionNode, ctx: set[str], setup: bool, tensors: TensorEvidence
) -> tuple[set[str], set[str]]:
    """Names that are tensor outputs of the node, and ctx attributes ``forward`` returns.

    A returned name counts only with evidence that it holds a tensor (``tensors`` is
    gathered without the return itself as evidence): a tuple of communication handles, a
    NumPy array or an index map gets no ``grad_fn``, so storing it makes no cycle."""
    params = {p.arg for p in parameters(fn)}
    nodes = list(own_nodes(fn))
    dirty: set[str] = set()
    nondiff: set[str] = set()
    for n in nodes:
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name)
            and n.func.value.id in ctx
            and n.func.attr in ("mark_dirty", "mark_non_differentiable")
        ):
            target = dirty if n.func.attr == "mark_dirty" else nondiff
            for a in n.args:
                v = a.value if isinstance(a, ast.Starred) else a
                if isinstance(v, ast.Name):
                    target.add(v.id)
    names: set[str] = set()
    attrs: set[str] = set()
    if setup:
        ps = parameters(fn)
        if len(ps) >= 3:
            names.add(ps[2].arg)
    else:
        for n in nodes:
            if isinstance(n, ast.Return) and n.value is not None:
                for r in elements(n.value):
                    if isinstance(r, ast.Name) and (r.id not in params or r.id in dirty):
                        if tensors.holds(r) or r.id in dirty:
                            names.add(r.id)
                    elif (returned := _ctx_attr(r, ctx)) is not None:
                        attrs.add(returned)
    # unpacking and views of outputs are outputs too (a, b = output; v = out.view(...))
    changed = True
    while changed:
        changed = False
        for n in nodes:
            if isinstance(n, ast.Assign) and _is_output(n.value, names):
                for t in n.targets:
                    for e in elements(t):
                        if isinstance(e, ast.Name) and e.id not in names:
                            names.add(e.id)
                            changed = True
    sequences = {
        t.id
        for n in nodes
        if isinstance(n, ast.Assign)
        and (
            isinstance(n.value, (ast.List, ast.ListComp))
            or (isinstance(n.value, ast.Call) and tail(n.value.func) in _SEQUENCES)
        )
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    return {
        n
        for n in names - nondiff - sequences
        if not name_words(n) & _INDEX_WORDS and not handle_named(n)
    }, attrs


def _is_output(e: ast.AST, outs: set[str]) -> bool:
    """Is ``e`` an output, a view of one, or a container holding one?"""
    if isinstance(e, ast.Name):
        return e.id in outs
    if isinstance(e, ast.Subscript):
        return _is_output(e.value, outs)
    if isinstance(e, ast.Attribute):
        return e.attr in _VIEWS and _is_output(e.value, outs)
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute):
        return e.func.attr in _VIEWS and _is_output(e.func.value, outs)
    if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_output(v.value if isinstance(v, ast.Starred) else v, outs) for v in e.elts)
    if isinstance(e, ast.Dict):
        return any(_is_output(v, outs) for v in e.values)
    return False


def _tensor_element(
    value: ast.AST, outs: set[str], fc: FunctionClass, names: dict[str, str]
) -> bool:
    """In ``setup_context``, ``output[k]`` is forward's k-th returned element: is that a
    tensor on forward's own evidence? (A NumPy array or an index map gets no grad_fn.)
    Anything else stored is judged as a whole."""
    if not (
        isinstance(value, ast.Subscript)
        and isinstance(value.value, ast.Name)
        and value.value.id in outs
        and isinstance(value.slice, ast.Constant)
        and isinstance(value.slice.value, int)
    ):
        return True
    forward = fc.method("forward")
    if forward is None:
        return True
    k = value.slice.value
    for n in own_nodes(forward):
        if isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple) and k < len(n.value.elts):
            element = n.value.elts[k]
            if isinstance(element, ast.Name) and (
                handle_named(element.id) or name_words(element.id) & _INDEX_WORDS
            ):
                return False
            evidence = TensorEvidence(forward, names, set(), returned=False)
            return evidence.holds(element)
    return True


# --- what lives anyway ---------------------------------------------------------------------

#: words naming a module's parameters and buffers: they live as long as the module
_WEIGHT_WORDS = words("weight weights bias biases param params parameter parameters buffer")


def _lives_anyway(value: ast.AST, names: dict[str, str]) -> str | None:
    """Why the stored value costs nothing beyond what lives anyway (a note, not a leak):
    a parameter, weight or buffer, or an RNG state (a few KB); None for anything else."""
    for n in ast.walk(value):
        if isinstance(n, ast.Call) and tail(n.func) == "get_rng_state":
            return "an RNG state (a few KB per call, not activations)"
    leaves = [
        v.generators[0].iter if isinstance(v, (ast.ListComp, ast.GeneratorExp)) else v
        for v in elements(value)
    ]
    if leaves and all(
        (isinstance(v, (ast.Name, ast.Attribute)) and name_words(tail(v)) & _WEIGHT_WORDS)
        or (isinstance(v, ast.Call) and tail(v.func) in ("parameters", "buffers"))
        for v in leaves
    ):
        return "a parameter or weight, which lives as long as its module anyway"
    if all(isinstance(v, ast.Name) and "rng" in name_words(v.id) for v in leaves):
        return "an RNG state (a few KB per call, not activations)"
    del names
    return None


# --- helpers read before judging ------------------------------------------------------------


class _Helpers:
    """Whether a call's callee, read where it is defined (this file first, else the one
    function of that name in the project), returns no tensor: its return annotation is a
    plain type, or none of its returned values holds one on its own evidence, with the
    parameters that received tensors taken as tensors (``_resolve_kv_heads(x, ...)``
    returns ``x.shape[2] // n``: an int)."""

    def __init__(self, source: Source, project: Project) -> None:
        self.source = source
        self.project = project

    def plain(self, call: ast.Call, caller: TensorEvidence) -> bool:
        if not isinstance(call.func, ast.Name):
            return False
        name = call.func.id
        local = self.project.defs(self.source).get(name, [])
        found = [(self.source, fn) for fn in local] or list(self.project.helpers(name))
        if len(found) != 1:
            return False  # not found, or several of that name: the name decides nothing
        src, fn = found[0]
        if plain_annotation(fn.returns):
            return True
        params = [p.arg for p in parameters(fn)]
        seed = {
            params[i]
            for i, a in enumerate(call.args)
            if i < len(params) and not isinstance(a, ast.Starred) and caller.holds(a)
        }
        names = self.project.memo("imports", src, src.tree, lambda: imports(src.tree, src.package))
        evidence = TensorEvidence(fn, names, set(), seed=seed, inputs=False, returned=False)
        returns = [n.value for n in own_nodes(fn) if isinstance(n, ast.Return) and n.value]
        return bool(returns) and not any(evidence.holds(r) for r in returns)


# --- the check ---------------------------------------------------------------------------


def _entry(fc: FunctionClass) -> tuple[FunctionNode, bool] | None:
    """The function that receives the forward ctx, and whether it is ``setup_context``."""
    setup = fc.method("setup_context")
    if setup is not None and parameters(setup):
        return setup, True
    fwd = fc.method("forward")
    if fwd is None or not parameters(fwd) or parameters(fwd)[0].arg in ("self", "cls"):
        return None
    return fwd, False


def _findings(source: Source, project: Project) -> tuple[list[Finding], list[Finding]]:
    """LF001's and LF002's findings in one file (both come from the same analysis)."""
    lf001: list[Finding] = []
    lf002: list[Finding] = []
    if not _DERIVES.search(source.text):
        return lf001, lf002  # no class names a ...Function base: skip the tree walks
    names = imports(source.tree, source.package)
    releases = _Releases(project, names)
    helpers = _Helpers(source, project)
    for fc in function_classes(source.tree, names):
        entry = _entry(fc)
        if entry is None:
            continue
        fn, setup = entry
        flow = Flow(fn)
        ctx = flow.aliases(parameters(fn)[0].arg)
        stores = sorted(_stores(fn, flow, ctx), key=lambda s: (s.node.lineno, s.node.col_offset))  # type: ignore[attr-defined]
        if not stores:
            continue
        shown = TensorEvidence(fn, names, ctx, flow=flow, returned=False)
        outs, out_attrs = _outputs(fn, ctx, setup, shown)
        cycle: set[str] = set()
        for s in stores:
            if setup and not _tensor_element(s.value, outs, fc, names):
                continue
            if s.attr not in cycle and (s.attr in out_attrs or _is_output(s.value, outs)):
                cycle.add(s.attr)
                lf002.append(
                    source.finding(
                        s.node,
                        "LF002",
                        f"{fc.node.name}.{s.attr}",
                        f"forward stores its output (or a view of it) on ctx.{s.attr}: the "
                        "output's grad_fn is this ctx, a reference cycle that outlives the "
                        "graph; save it with ctx.save_for_backward(...) and read "
                        "ctx.saved_tensors in backward",
                    )
                )
        if fc.releases:
            continue
        back = fc.method("backward") or fc.method("vjp")
        if back is None or not parameters(back):
            continue  # the backward lives elsewhere: nothing to judge
        released = releases.of(back, parameters(back)[0].arg)
        if _ALL in released:
            continue
        evidence: TensorEvidence | None = None
        seen: set[str] = set()
        for s in stores:
            if s.attr in seen or s.attr in released or s.attr in cycle:
                continue
            if evidence is None:
                evidence = TensorEvidence(fn, names, ctx, flow=flow, plain_call=helpers.plain)
            if metadata_named(s.attr, s.value) or not evidence.holds(
                s.value, excluded=s.not_tensors
            ):
                continue
            seen.add(s.attr)
            because = evidence.explain(s.value)
            anyway = _lives_anyway(s.value, names)
            if anyway is not None:
                lf001.append(
                    source.finding(
                        s.node,
                        "LF001",
                        f"{fc.node.name}.{s.attr}",
                        f"ctx.{s.attr} is never released by backward, but it holds {anyway}: "
                        "the graph keeps it a little longer, no activations",
                        NOTE,
                    )
                )
                continue
            lf001.append(
                source.finding(
                    s.node,
                    "LF001",
                    f"{fc.node.name}.{s.attr}",
                    f"ctx.{s.attr} can hold tensors (because {because}) and backward never "
                    "releases it, so they stay alive as long as the graph does; set it to "
                    "None in backward after its last use (or save tensors with "
                    "ctx.save_for_backward), or subclass leakfree.Function",
                )
            )
    return lf001, lf002


# Both rules read the same analysis; the runner checks one file with every rule before the
# next, so the last file's result is kept (a strong reference to one Source, no more).
_last: list[tuple[Source, Project, tuple[list[Finding], list[Finding]]]] = []


def _cached(source: Source, project: Project) -> tuple[list[Finding], list[Finding]]:
    if _last and _last[0][0] is source and _last[0][1] is project:
        return _last[0][2]
    result = _findings(source, project)
    _last[:] = [(source, project, result)]
    return result


def _check_lf001(source: Source, project: Project) -> Iterable[Finding]:
    return list(_cached(source, project)[0])


def _check_lf002(source: Source, project: Project) -> Iterable[Finding]:
    return list(_cached(source, project)[1])


#: only a file whose base lists name a Function can define one (the runner's text filter)
_NEEDS = ("Function)", "Function,")
#: a class statement with a base ending in Function (same-file subclasses need one too)
_DERIVES = re.compile(r"^[ \t]*class\s+\w+\s*\([^)]*Function\b", re.MULTILINE)

RULES: tuple[Rule, ...] = (
    Rule(
        "LF001",
        "ctx-outlives-backward",
        "A custom autograd Function keeps tensors on ctx (outside save_for_backward) that "
        "backward never releases: they live as long as the graph.",
        _CONFIRM_LF001,
        _check_lf001,
        _NEEDS,
    ),
    Rule(
        "LF002",
        "output-on-ctx",
        "A custom autograd Function stores its output (or a view of it) on ctx: a "
        "reference cycle through the output's grad_fn.",
        _CONFIRM_LF002,
        _check_lf002,
        _NEEDS,
    ),
)
