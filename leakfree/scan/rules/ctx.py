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

What counts, decided from the code only (see :mod:`leakfree.scan._syntax` and
:mod:`leakfree.scan._tensors`):

- **A Function**, however its base is spelled
  (:func:`~leakfree.scan._syntax.function_classes`): through the file's imports or a
  module-level name (an alias, a name bound under ``if``, ``A if flag else B``), a class of
  the same file or of another file of the scanned tree that is one, or, for a base it
  cannot resolve, the shape of one (a static ``forward``/``setup_context`` and a
  ``backward``/``vjp``). ``leakfree.Function`` subclasses (on every branch of a flag),
  and classes the file hands to ``release_after_backward``, release their ctx at run
  time: LF001 is quiet for them, LF002 is not (the cycle forms before any backward).
- **The ctx**: the first parameter of ``setup_context`` when the class defines one, else
  of ``forward``, whatever its spelling (``ctx``, ``func_ctx``, ``context``), and plain
  names assigned from it (``c = ctx``). Stores counted: ``ctx.a = v`` (also in tuple
  targets, annotated and augmented), ``setattr(ctx, "a", v)``, ``ctx.a[k] = v`` and
  ``ctx.a.append(v)`` / ``extend`` / ``add`` / ``insert``.
- **A tensor, a scalar or unknown** (LF001), on evidence a reader can see
  (:class:`~leakfree.scan._tensors.TensorEvidence`); only a tensor is reported. A tensor:
  made by a ``torch`` function or a tensor method, arithmetic or comparison of tensors, a
  name used as one or passed to ``save_for_backward``, a forward input (its first, its
  ``*args``, one named ``...mask``/``...states``/``...logits``/``...probs``), a
  tensor-named field of a call's result, a call handed one whose callee (read where it is
  defined, element by element for ``a, b = helper(x)``) does not show otherwise, and a
  parameter passed straight to ctx that backward uses as a tensor. A scalar: literals,
  metadata (``.shape``, ``len()``), plain annotations, number defaults, the
  ``isinstance(x, int)`` branch, names that say metadata (``grad_shape``). Unknown:
  everything else (parameters only passed through, ``self.`` attributes, constructors
  without tensor arguments).
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

from leakfree.scan._callables import ReturnReader, autograd_classes, imported_names
from leakfree.scan._flow import Flow
from leakfree.scan._model import NOTE, Project, ScanFinding, ScanRule, Source
from leakfree.scan._syntax import (
    FunctionClass,
    FunctionNode,
    attr_of,
    elements,
    name_words,
    own_nodes,
    parameters,
    tail,
    walk,
    words,
)
from leakfree.scan._tensors import TENSOR_USES, TensorEvidence, metadata_named
from leakfree.scan.rules._ctx_outputs import is_output, outputs, tensor_element
from leakfree.scan.rules._ctx_releases import ALL, Releases

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
_MAX_DEPTH = 4
#: words naming integer or boolean outputs, which never get a grad_fn (no cycle)


@dataclass(frozen=True)
class _Store:
    attr: str
    value: ast.AST
    node: ast.AST
    #: names an enclosing ``if torch.is_tensor(x)`` proves hold no tensor here
    not_tensors: frozenset[str] = frozenset()
    #: the position in ``a, ctx.b = f(x)`` (the value is the whole call), else None
    index: int | None = None


def _stores(fn: FunctionNode, flow: Flow, ctx: set[str]) -> Iterator[_Store]:
    """Every value ``fn`` puts into a ctx attribute (``ctx.a = v``, ``ctx.a[k] = v``,
    ``ctx.a.append(v)``..., ``setattr(ctx, "a", v)``), in source order."""
    for step in flow.steps:
        target = step.target.value if isinstance(step.target, ast.Subscript) else step.target
        attr = attr_of(target, ctx)
        if attr is not None and (step.how in _ADDERS or step.how in ("=", "+=")):
            yield _Store(attr, step.value, step.node, step.not_tensors, step.index)
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


# --- what lives anyway ---------------------------------------------------------------------

#: words naming a module's parameters and buffers: they live as long as the module
_WEIGHT_WORDS = words("weight weights bias biases param params parameter parameters buffer")


#: names of packed sequences' boundaries (``cu_seqlens``, ``chunk_indices``): batch + 1
#: integers, or one pair per chunk, kept beside varlen kernels
_BOUNDARIES = re.compile(r"^(?:cu_seq_?lens\w*|cu_seqlens\w*|chunk_indices\w*|seq_?lens(?:_cpu)?)$")
#: rotary embedding tables (``cos``, ``sin_cached``, ``freqs_cis``)
_ROTARY = re.compile(r"^(?:cos|sin)(?:_\w+)?$|^freqs?_cis$|^inv_freq$")
#: words that make a "bias" an activation's, not a module's (``attn_bias``, ``alibi``)
_NOT_WEIGHT_WORDS = words("attn attention alibi mask pos position rel relative")


def _weight_named(name: str) -> bool:
    """``weight``, ``ln_bias``, ``weight_chunked``: a module's own; not ``attn_bias`` nor
    ``attn_bias_tensor`` (an attention bias, made per call)."""
    found = name_words(name)
    return bool(found & _WEIGHT_WORDS) and not found & _NOT_WEIGHT_WORDS


#: methods whose result shares (or copies without growing) the data they are called on
_SAME_AS = frozenset({"detach", "view", "t", "contiguous", "reshape", "to", "float", "half"})


def _leaves(value: ast.AST) -> list[ast.AST]:
    """The values a store may hold: the elements of a display, both branches of ``a if c
    else b`` (a ``None`` branch holds nothing), a comprehension's source."""
    out: list[ast.AST] = []
    for v in elements(value):
        if isinstance(v, ast.IfExp):
            out += [b for b in _leaves(v.body) + _leaves(v.orelse) if not _none(b)]
        elif isinstance(v, (ast.ListComp, ast.GeneratorExp)):
            out.append(v.generators[0].iter)
        else:
            out.append(v)
    return out


def _none(e: ast.AST) -> bool:
    return isinstance(e, ast.Constant) and e.value is None


def _same_data(e: ast.AST) -> ast.AST:
    """``bias.detach()`` -> ``bias``: what a view or a detached alias is of."""
    while isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr in _SAME_AS:
        e = e.func.value
    return e


def _lives_anyway(value: ast.AST) -> str | None:
    """Why the stored value costs nothing beyond what lives anyway (a note, not a leak):
    a parameter, weight or buffer, or an RNG state (a few KB); None for anything else."""
    for n in walk(value):
        if isinstance(n, ast.Call) and "rng" in name_words(tail(n.func)):
            # get_rng_state(), Megatron's _get_all_rng_states()
            return "an RNG state (a few KB per call, not activations)"
    leaves = [_same_data(v) for v in _leaves(value)]
    if leaves and all(
        (isinstance(v, (ast.Name, ast.Attribute)) and _weight_named(tail(v)))
        or (isinstance(v, ast.Call) and tail(v.func) in ("parameters", "buffers"))
        for v in leaves
    ):
        return "a parameter or weight, which lives as long as its module anyway"
    if all(isinstance(v, ast.Name) and "rng" in name_words(v.id) for v in leaves):
        return "an RNG state (a few KB per call, not activations)"
    if leaves and all(isinstance(v, ast.Name) and _BOUNDARIES.match(v.id) for v in leaves):
        return "sequence boundaries (a few bytes per sequence, not activations)"
    if leaves and all(isinstance(v, ast.Name) and _ROTARY.match(v.id) for v in leaves):
        return "rotary position tables (positions x head size, most often the module's cache)"
    return None


# --- what backward does with an attribute ---------------------------------------------------


def _used_as_tensors(back: FunctionNode, names: dict[str, str]) -> dict[str, str]:
    """Attribute -> why: the ctx attributes backward uses as tensors, directly
    (``ctx.a.view(...)``, ``torch.gather(ctx.a, ...)``) or through a name it reads one
    into (``idx = ctx.sorted_bucket_idx`` ... ``idx.unsqueeze(-1)``). Evidence for a
    stored value that forward alone does not show to be a tensor (a parameter passed
    straight through to ctx)."""
    flow = Flow(back)
    ctx = flow.aliases(parameters(back)[0].arg)
    read: dict[str, str] = {}  # local name -> the attribute it was read from
    for step in flow.steps:
        attr = attr_of(step.value, ctx)
        if attr is not None and step.how == "=" and isinstance(step.target, ast.Name):
            read[step.target.id] = attr
    out: dict[str, str] = {}
    for n in own_nodes(back):
        if isinstance(n, ast.Attribute) and n.attr in TENSOR_USES:
            attr = attr_of(n.value, ctx)
            if attr is not None:
                out.setdefault(attr, f"backward uses {ast.unparse(n)} at L{n.lineno}")
    if read:
        used = TensorEvidence(back, names, ctx, flow=flow, inputs=False, returned=False)
        for local, attr in read.items():
            reason = used.why.get(local)
            if isinstance(reason, str):  # direct evidence, not a flow from another name
                out.setdefault(attr, f"backward reads it into {local}: {reason}")
    return out


# --- the check ---------------------------------------------------------------------------


def _passed_through(value: ast.AST, evidence: TensorEvidence) -> bool:
    """Is ``value`` a name forward neither shows to be a tensor nor to be a number (a
    parameter handed straight to ctx): what backward does with it then decides."""
    return (
        isinstance(value, ast.Name)
        and value.id not in evidence.plain
        and value.id not in evidence.literals
    )


def _entry(fc: FunctionClass) -> tuple[FunctionNode, bool] | None:
    """The function that receives the forward ctx, and whether it is ``setup_context``."""
    setup = fc.method("setup_context")
    if setup is not None and parameters(setup):
        return setup, True
    fwd = fc.method("forward")
    if fwd is None or not parameters(fwd) or parameters(fwd)[0].arg in ("self", "cls"):
        return None
    return fwd, False


class _Judge:
    """Whether a store holds tensors (LF001), and why: the forward's own evidence, read
    once per Function; what backward does with each attribute, read only when forward's
    evidence says nothing."""

    def __init__(
        self,
        fn: FunctionNode,
        back: FunctionNode,
        names: dict[str, str],
        ctx: set[str],
        flow: Flow,
        helpers: ReturnReader,
    ) -> None:
        self.fn, self.back, self.names, self.ctx, self.flow = fn, back, names, ctx, flow
        self.helpers = helpers
        self._evidence: TensorEvidence | None = None
        self._used: dict[str, str] | None = None

    def because(self, s: _Store) -> str | None:
        """Why ``s`` holds tensors, or None when it does not on the evidence."""
        if self._evidence is None:  # only for a Function with a store left to judge
            self._evidence = TensorEvidence(
                self.fn, self.names, self.ctx, flow=self.flow, callee=self.helpers.returns
            )
        evidence = self._evidence
        if metadata_named(s.attr, s.value):
            return None
        if evidence.holds(s.value, excluded=s.not_tensors):
            if (
                s.index is not None
                and isinstance(s.value, ast.Call)
                and self.helpers.plain(s.value, evidence, s.index)
            ):
                return None  # ``o, lse, ctx.scale = helper(q)``: the helper's third is a float
            return evidence.explain(s.value)
        if self._used is None:
            self._used = _used_as_tensors(self.back, self.names)
        if s.attr in self._used and _passed_through(s.value, evidence):
            return self._used[s.attr]
        return None


def _lf001(source: Source, fc: FunctionClass, s: _Store, because: str) -> ScanFinding:
    """The finding for a store that holds tensors: a note for what lives anyway."""
    anyway = _lives_anyway(s.value)
    if anyway is not None:
        return source.finding(
            s.node,
            "LF001",
            f"{fc.node.name}.{s.attr}",
            f"ctx.{s.attr} is never released by backward, but it holds {anyway}: "
            "the graph keeps it a little longer, no activations",
            NOTE,
        )
    return source.finding(
        s.node,
        "LF001",
        f"{fc.node.name}.{s.attr}",
        f"ctx.{s.attr} can hold tensors (because {because}) and backward never "
        "releases it, so they stay alive as long as the graph does; set it to "
        "None in backward after its last use (or save tensors with "
        "ctx.save_for_backward), or subclass leakfree.Function",
    )


def _findings(source: Source, project: Project) -> tuple[list[ScanFinding], list[ScanFinding]]:
    """LF001's and LF002's findings in one file (both come from the same analysis)."""
    lf001: list[ScanFinding] = []
    lf002: list[ScanFinding] = []
    names = imported_names(project, source)
    releases = Releases(project, names)
    helpers = ReturnReader(source, project)
    for fc in autograd_classes(project, source):
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
        outs, out_attrs = outputs(fn, ctx, setup, shown)
        cycle: set[str] = set()
        for s in stores:
            if setup and not tensor_element(s.value, outs, fc, names):
                continue
            if s.attr not in cycle and (s.attr in out_attrs or is_output(s.value, outs)):
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
        if ALL in released:
            continue
        judge = _Judge(fn, back, names, ctx, flow, helpers)
        seen: set[str] = set()
        for s in stores:
            if s.attr in seen or s.attr in released or s.attr in cycle:
                continue
            because = judge.because(s)
            if because is None:
                continue
            seen.add(s.attr)
            lf001.append(_lf001(source, fc, s, because))
    return lf001, lf002


def _cached(source: Source, project: Project) -> tuple[list[ScanFinding], list[ScanFinding]]:
    """Both rules read the same analysis, once per file: kept in the project's memo and
    dropped with the file (a module-level cache would keep the last project, and every
    syntax tree it holds, alive after the scan)."""
    return project.memo("ctx rules", source, source.tree, lambda: _findings(source, project))


def _check_lf001(source: Source, project: Project) -> Iterable[ScanFinding]:
    return list(_cached(source, project)[0])


def _check_lf002(source: Source, project: Project) -> Iterable[ScanFinding]:
    return list(_cached(source, project)[1])


#: a file that can define a Function names one or defines its backward (the runner's text
#: filter: a subclass of another file's Function, or of an alias, still has a backward)
_NEEDS = ("Function", "def backward", "def setup_context")

RULES: tuple[ScanRule, ...] = (
    ScanRule(
        "LF001",
        "ctx-outlives-backward",
        "A custom autograd Function keeps tensors on ctx (outside save_for_backward) that "
        "backward never releases: they live as long as the graph.",
        _CONFIRM_LF001,
        _check_lf001,
        _NEEDS,
    ),
    ScanRule(
        "LF002",
        "output-on-ctx",
        "A custom autograd Function stores its output (or a view of it) on ctx: a "
        "reference cycle through the output's grad_fn.",
        _CONFIRM_LF002,
        _check_lf002,
        _NEEDS,
    ),
)
