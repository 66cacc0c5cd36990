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
  names assigned from it (``c = ctx``); ``backward``'s first parameter. Stores counted
  wherever they are made (forward, setup_context, backward, helpers handed ctx) and
  whatever part they fill (the attribute, a key, an item, a field of the object kept):
  :mod:`~leakfree.scan.rules._ctx_stores`.
- **A tensor, a scalar, opaque or unknown** (LF001), on evidence a reader can see
  (:class:`~leakfree.scan._tensors.TensorEvidence`); only a tensor is reported. A tensor:
  made by a ``torch`` function or a tensor method, arithmetic or comparison of tensors, a
  name used as one or passed to ``save_for_backward``, a forward input (its first, its
  ``*args``, one named ``...mask``/``...states``/``...logits``/``...probs``, one backward
  returns a gradient for), a tensor-named field of a call's result, a field of a class
  of the tree that holds tensors (:mod:`~leakfree.scan._fields`), a call handed one whose
  callee (read where it is defined, element by element for ``a, b = helper(x)``) does
  not show otherwise, and a value backward uses as one
  (:mod:`~leakfree.scan.rules._ctx_uses`). A scalar: literals, metadata (``.shape``,
  ``len()``), plain annotations (unless every caller of the tree hands the other kind:
  :mod:`~leakfree.scan._callers`), number defaults, the ``isinstance(x, int)`` branch,
  names that say metadata (``grad_shape``). Opaque: what is handed to ``torch.ops`` /
  ``torch.classes``, a parameter annotated as a TorchScript class, names that say a
  handle, a request, an event or a stream. Unknown: everything else (parameters only
  passed through, ``self.`` attributes, constructors without tensor arguments).
- **Released, where it happens** (LF001): ``backward`` or ``vjp`` (the class's or a
  same-file base's) sets the attribute to ``None`` or another constant or empty container,
  deletes it (``del ctx.a``, ``delattr``), clears or pops it, clears the whole ctx
  (``ctx.__dict__.clear()``, ``setattr``/``delattr`` with a computed name), or passes
  ctx to a function of the scanned tree that does one of these to its parameter, or
  passes ``ctx.a`` to a plain-named one that clears it (followed by name through
  :meth:`Project.helpers`, four calls deep; any same-named function that releases
  counts). A part of the attribute (a field, a key, the items) is released by a clear of
  that part in the Functions that share the object
  (:mod:`~leakfree.scan.rules._ctx_holders`). A release on any branch counts: the rule
  does not judge control flow.
- **Notes**: what lives anyway or costs a few numbers whatever the data
  (:mod:`~leakfree.scan.rules._ctx_notes`).
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
from collections.abc import Iterable

from leakfree.scan._callables import ReturnReader, autograd_classes, imported_names
from leakfree.scan._callers import Callers
from leakfree.scan._fields import Fields
from leakfree.scan._flow import Flow
from leakfree.scan._model import NOTE, Project, ScanFinding, ScanRule, Source
from leakfree.scan._syntax import FunctionClass, parameters
from leakfree.scan._tensors import TensorEvidence
from leakfree.scan.rules._ctx_holders import Holders, Tools, Verdict
from leakfree.scan.rules._ctx_notes import lives_anyway
from leakfree.scan.rules._ctx_outputs import is_output, outputs, tensor_element
from leakfree.scan.rules._ctx_releases import Releases
from leakfree.scan.rules._ctx_stores import BACKWARD, FORWARD, ctx_param, stores

__all__ = ["RULES"]

_CONFIRM_LF001 = (
    "leakfree.diagnostics.find_retained (lists what each graph's ctx still holds after "
    "backward); leakfree.testing.assert_no_leak around one step"
)
_CONFIRM_LF002 = (
    "subclass leakfree.Function (raises ReferenceCycleError naming the attribute); "
    "leakfree.testing.assert_no_leak with gc disabled"
)


def _lf001(source: Source, fc: FunctionClass, v: Verdict, names: dict[str, str]) -> ScanFinding:
    """The finding for an attribute that keeps tensors: a note for what lives anyway."""
    s = v.store
    symbol = f"{fc.node.name}.{s.attr}"
    bound: dict[str, list[ast.AST]] = {}
    for name, value, _ in Flow(s.fn).assigned():
        bound.setdefault(name, []).append(value)
    anyway = lives_anyway(s.attr, s.value, names, bound) if v.part is None else None
    if anyway is not None:
        return source.finding(
            s.node,
            "LF001",
            symbol,
            f"ctx.{s.attr} is never released by backward, but it holds {anyway}: "
            "the graph keeps it a little longer, no activations",
            NOTE,
            f"ctx.{s.attr} holds {anyway}",
        )
    if v.part is not None:
        what = f"ctx.{s.attr} keeps an object whose {v.part} holds tensors"
        where = "" if v.by == FORWARD else f" (stored by {v.by})"
        evidence = f"{what}{where}, because {v.because}; nothing clears it"
        return source.finding(
            s.node,
            "LF001",
            symbol,
            f"{what}{where} (because {v.because}) and nothing clears it, so they stay alive "
            "as long as the graph does; set it to None (or pop it) in backward after its "
            "last use, or subclass leakfree.Function",
            evidence=evidence,
        )
    if v.by == BACKWARD:
        return source.finding(
            s.node,
            "LF001",
            symbol,
            f"backward stores tensors on ctx.{s.attr} (because {v.because}) and nothing "
            "releases them, so they stay alive as long as the graph does; set it to None "
            "once used (or keep them elsewhere), or subclass leakfree.Function",
            evidence=f"backward stores tensors on ctx.{s.attr}, because {v.because}",
        )
    return source.finding(
        s.node,
        "LF001",
        symbol,
        f"ctx.{s.attr} can hold tensors (because {v.because}) and backward never "
        "releases it, so they stay alive as long as the graph does; set it to "
        "None in backward after its last use (or save tensors with "
        "ctx.save_for_backward), or subclass leakfree.Function",
        evidence=f"ctx.{s.attr} holds tensors because {v.because}; backward never releases it",
    )


def _cycles(
    source: Source, project: Project, fc: FunctionClass, names: dict[str, str]
) -> list[ScanFinding]:
    """LF002: forward stores one of its outputs (or a view) on ctx."""
    entry = fc.method("setup_context")
    setup = entry is not None and bool(parameters(entry))
    if not setup:
        entry = fc.method("forward")
    param = ctx_param(entry) if entry is not None else None
    if entry is None or param is None:
        return []
    flow = Flow(entry)
    ctx = flow.aliases(param)
    own = [
        s
        for s in stores(entry, param, FORWARD, project, source, follow=False)
        if s.part is None or s.part[0] != "field"
    ]
    if not own:
        return []
    shown = TensorEvidence(entry, names, ctx, flow=flow, returned=False)
    outs, out_attrs = outputs(entry, ctx, setup, shown)
    found: dict[str, ScanFinding] = {}
    for s in sorted(own, key=lambda s: (s.node.lineno, s.node.col_offset)):  # type: ignore[attr-defined]
        if setup and not tensor_element(s.value, outs, fc, names):
            continue
        if s.attr not in found and (s.attr in out_attrs or is_output(s.value, outs)):
            found[s.attr] = source.finding(
                s.node,
                "LF002",
                f"{fc.node.name}.{s.attr}",
                f"forward stores its output (or a view of it) on ctx.{s.attr}: the "
                "output's grad_fn is this ctx, a reference cycle that outlives the "
                "graph; save it with ctx.save_for_backward(...) and read "
                "ctx.saved_tensors in backward",
            )
    return list(found.values())


def _findings(source: Source, project: Project) -> tuple[list[ScanFinding], list[ScanFinding]]:
    """LF001's and LF002's findings in one file (both come from the same analysis)."""
    lf001: list[ScanFinding] = []
    lf002: list[ScanFinding] = []
    names = imported_names(project, source)
    classes = autograd_classes(project, source)
    tools = Tools(
        source, project, names, Releases(project, names), ReturnReader(source, project),
        classes, Fields(project), Callers(project),
    )  # fmt: skip
    for fc in classes:
        cycles = _cycles(source, project, fc, names)
        lf002 += cycles
        if fc.releases:
            continue
        holders = Holders.of(fc, tools)
        if holders is None:
            continue  # no forward ctx, or the backward lives elsewhere: nothing to judge
        skip = {f.symbol.rpartition(".")[2] for f in cycles}
        for verdict in holders.verdicts(skip):
            lf001.append(_lf001(source, fc, verdict, names))
    return lf001, lf002


def _cached(source: Source, project: Project) -> tuple[list[ScanFinding], list[ScanFinding]]:
    """Both rules read the same analysis, once per file: kept in the project's memo and
    dropped with the file (a module-level cache would keep the last project, and every
    syntax tree it holds, alive after the scan)."""
    return project.memo("ctx rules", source, source.tree, lambda: _findings(source, project))


def _may_define(text: str) -> bool:
    """Can this file define a Function with a forward (or setup_context) to judge? Both
    rules read the forward's stores, and a Function's forward is a static method."""
    return ("def forward" in text or "def setup_context" in text) and "staticmethod" in text


def _check_lf001(source: Source, project: Project) -> Iterable[ScanFinding]:
    return list(_cached(source, project)[0]) if _may_define(source.text) else []


def _check_lf002(source: Source, project: Project) -> Iterable[ScanFinding]:
    return list(_cached(source, project)[1]) if _may_define(source.text) else []


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
        "set the attribute to None in backward after its last use (or save tensors with "
        "ctx.save_for_backward), or subclass leakfree.Function",
    ),
    ScanRule(
        "LF002",
        "output-on-ctx",
        "A custom autograd Function stores its output (or a view of it) on ctx: a "
        "reference cycle through the output's grad_fn.",
        _CONFIRM_LF002,
        _check_lf002,
        _NEEDS,
        "save the output with ctx.save_for_backward(...) and read ctx.saved_tensors in backward",
    ),
)
