"""LF001's evidence from use: what backward (and the helpers it hands ctx to) does with a
value forward kept on ctx, for the values forward alone does not show to be a tensor or a
number (a parameter passed straight through, what a compiled op returned).

A kept value is a tensor when backward

* uses it with a tensor-only attribute or method (``ctx.idx.unsqueeze(-1)``), directly or
  through a name it reads it into, or through the element of a tuple it unpacks
  (``A, B, idx = ctx.cache`` ... ``B.transpose(1, 2)``);
* hands it first to a torch function (``torch.gather(ctx.idx, ...)``), or to a function
  or class of the scanned tree at a parameter annotated as a tensor;
* multiplies it as a matrix (``g @ ctx.proj``), or makes with it arithmetic or a comparison
  whose result it uses as a tensor, the other operands being numbers
  (``(ctx.slots // 4).long()``);
* hands it to the backward half of the compiled op that returned it in forward
  (MinkowskiEngine's ``fw_fn = get_function("LocalPoolingForward", x)`` ... ``bw_fn =
  get_function("LocalPoolingBackward", g)``; ``ext.op_forward`` / ``ext.op_backward``;
  ``torch.ops.ns.op`` / ``torch.ops.ns.op_backward``). What was *handed* to the compiled
  op is opaque (a TorchScript object, a handle), whatever else it is handed to.

And a forward input is a tensor when backward returns a gradient for it: autograd refuses
a gradient for anything else (:func:`gradient_inputs`).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from leakfree.scan._flow import Flow
from leakfree.scan._model import Project, Source
from leakfree.scan._syntax import (
    FunctionNode,
    attr_of,
    own_nodes,
    parameters,
    resolve,
    tensor_annotation,
    words,
)
from leakfree.scan._tensors import (
    FACTORIES,
    OPAQUE_CALLS,
    TENSOR_USES,
    TensorEvidence,
    torch_makes_tensor,
)
from leakfree.scan.rules._ctx_stores import helpers

#: methods only a tensor has, beside :data:`TENSOR_USES`: casts of an arithmetic result
_CASTS = words("long int bool float double half bfloat16 byte short to cuda cpu")
#: words that say which half of an op a name is (dropped to pair the halves)
_HALVES = words("forward backward fwd bwd fw bw")
_DEPTH = 3

#: (attribute, element of a tuple it holds or None for the whole) -> why
Uses = dict[tuple[str, int | None], str]


def gradient_inputs(forward: FunctionNode, backward: FunctionNode, setup: bool) -> dict[str, str]:
    """Forward's inputs backward returns a gradient for (a tuple element that is not
    ``None`` nor a name bound only to ``None``, before any ``*rest``; a value alone only
    for a forward of one input and no ``*args``), with the reason: they are tensors.
    Nothing for a Function with ``setup_context`` (its names are not forward's)."""
    if setup:
        return {}
    params = [p.arg for p in parameters(forward)][1:]  # ctx
    nones = _bound_to_none(backward)
    out: dict[str, str] = {}
    for n in own_nodes(backward):
        if not isinstance(n, ast.Return) or n.value is None:
            continue
        if isinstance(n.value, ast.Tuple):
            values = n.value.elts
        elif (
            len(params) == 1
            and forward.args.vararg is None
            and isinstance(n.value, (ast.Name, ast.Attribute))
        ):
            values = [n.value]  # one input: its gradient alone
        else:
            continue  # a tuple built some other way (``(None,) * 5 + grads``): unread
        for i, v in enumerate(values):
            if isinstance(v, ast.Starred) or i >= len(params):
                break
            none = (isinstance(v, ast.Constant) and v.value is None) or (
                isinstance(v, ast.Name) and v.id in nones
            )
            if not none:
                out.setdefault(
                    params[i], f"backward returns a gradient for {params[i]} at L{n.lineno}"
                )
    return out


def _bound_to_none(fn: FunctionNode) -> set[str]:
    """Names ``fn`` binds only to ``None`` (``grad_edges = None``)."""
    values: dict[str, list[ast.AST]] = {}
    for name, value, _ in Flow(fn).assigned():
        values.setdefault(name, []).append(value)
    for n in own_nodes(fn):  # ``dx = dfu = ... = None`` binds several names at once
        if isinstance(n, ast.Assign) and len(n.targets) > 1:
            for t in n.targets:
                if isinstance(t, ast.Name):
                    values.setdefault(t.id, []).append(n.value)
    return {
        name
        for name, vs in values.items()
        if all(isinstance(v, ast.Constant) and v.value is None for v in vs)
    }


def op_key(call: ast.Call, fn: FunctionNode) -> tuple[str, ...] | None:
    """The compiled op a call runs, without which half it is: the words of the callee's
    dotted name and of its string arguments when the callee is a name ``fn`` binds to a
    call (``fw_fn = get_function("LocalPoolingForward", x)``), the forward / backward
    words dropped; None for a plain name nothing binds."""
    func: ast.AST = call.func
    parts: list[str] = []
    if isinstance(func, ast.Name):
        made = [
            n.value
            for n in own_nodes(fn)
            if isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Call)
            and any(isinstance(t, ast.Name) and t.id == func.id for t in n.targets)
        ]
        if len(made) != 1:
            return None
        func = made[0].func
        parts += [
            a.value
            for a in made[0].args
            if isinstance(a, ast.Constant) and isinstance(a.value, str)
        ]
    text = ".".join(filter(None, [ast.unparse(func), *parts]))
    return tuple(w for w in _words(text) if w not in _HALVES)


def _words(text: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", text)
    return [w.lower() for w in re.split(r"[^A-Za-z0-9]+", spaced) if w]


def _is_backward_half(call: ast.Call, fn: FunctionNode) -> bool:
    func: ast.AST = call.func
    text = ast.unparse(func)
    if isinstance(func, ast.Name):
        made = [
            n.value
            for n in own_nodes(fn)
            if isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Call)
            and any(isinstance(t, ast.Name) and t.id == func.id for t in n.targets)
        ]
        text = " ".join(ast.unparse(m) for m in made)
    return bool(set(_words(text)) & {"backward", "bwd", "bw"})


class BackwardUses:
    """What backward, and the helpers of the scanned tree it hands ctx to, do with each
    ctx attribute (:data:`Uses`). ``made`` maps a kept attribute to the compiled op whose
    result forward kept in it (:func:`op_key`)."""

    def __init__(
        self,
        source: Source,
        project: Project,
        names: dict[str, str],
        made: dict[str, tuple[str, ...]],
    ) -> None:
        self.source = source
        self.project = project
        self.names = names
        self.made = made

    def of(self, fn: FunctionNode, ctx_param: str, depth: int = 0) -> Uses:
        flow = Flow(fn)
        ctx = flow.aliases(ctx_param)
        reads = _reads(flow, ctx)
        out: Uses = {}
        for n in own_nodes(fn):
            for key, why in self._direct(n, fn, ctx, reads):
                out.setdefault(key, why)
        if reads:
            grads = [p.arg for p in parameters(fn)[1:]]
            if fn.args.vararg is not None:
                grads.append(fn.args.vararg.arg)
            evidence = TensorEvidence(
                fn, self.names, ctx, flow=flow, inputs=False, returned=False, seed=grads
            )
            for local, key in reads.items():
                reason = evidence.why.get(local)
                if isinstance(reason, str) and local not in grads:
                    out.setdefault(key, f"backward reads it into {local}: {reason}")
        if depth < _DEPTH:
            for helper, param in helpers(fn, ctx, self.project, self.source):
                for key, why in self.of(helper, param, depth + 1).items():
                    out.setdefault(key, f"{why} (in {helper.name}, which backward hands ctx)")
        return out

    def _direct(
        self,
        n: ast.AST,
        fn: FunctionNode,
        ctx: set[str],
        reads: dict[str, tuple[str, int | None]],
    ) -> Iterator[tuple[tuple[str, int | None], str]]:
        """The uses one node shows as a tensor's."""

        def kept(e: ast.AST) -> tuple[str, int | None] | None:
            attr = attr_of(e, ctx)
            if attr is not None:
                return attr, None
            return reads.get(e.id) if isinstance(e, ast.Name) else None

        at = f"at L{getattr(n, 'lineno', 0)}"
        if isinstance(n, ast.Attribute) and n.attr in TENSOR_USES:
            attr = attr_of(n.value, ctx)
            if attr is not None:
                yield (attr, None), f"backward uses {ast.unparse(n)} {at}"
        elif isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult):
            for side in (n.left, n.right):
                if (key := kept(side)) is not None:
                    yield key, f"backward multiplies it as a matrix: {ast.unparse(n)} {at}"
        elif (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr in _CASTS | TENSOR_USES
            and isinstance(n.func.value, (ast.BinOp, ast.Compare))
        ):
            unknown = [x for x in _operands(n.func.value) if not _number(x)]
            if len(unknown) == 1 and (key := kept(unknown[0])) is not None:
                yield key, f"backward uses {ast.unparse(n)} as a tensor {at}"
        if isinstance(n, ast.Call):
            yield from self._handed(n, fn, kept, at)

    def _handed(self, n: ast.Call, fn: FunctionNode, kept, at: str):  # type: ignore[no-untyped-def]
        """A kept value handed to a torch function (first), to an annotated parameter of
        the scanned tree, or to the backward half of the op that made it."""
        full = resolve(n.func, self.names) or ""
        if full.startswith("torch.") and not full.startswith(OPAQUE_CALLS):
            sizes = full.rpartition(".")[2] in FACTORIES  # torch.empty(n, ...): a size
            if n.args and torch_makes_tensor(full) and not sizes and (key := kept(n.args[0])):
                yield key, f"backward hands it to {full} {at}"
            return
        handed: list[tuple[int | str, ast.expr]] = list(enumerate(n.args))
        handed += [(k.arg, k.value) for k in n.keywords if k.arg]
        for where, a in handed:
            key = kept(a)
            if key is None:
                continue
            made = self.made.get(key[0])
            if made is not None and _is_backward_half(n, fn) and op_key(n, fn) == made:
                yield (
                    key,
                    (
                        f"backward hands it to {ast.unparse(n.func)}, the backward half of the op "
                        f"that made it, {at}"
                    ),
                )
            elif self._annotated_tensor(n, where):
                yield (
                    key,
                    (
                        f"backward hands it to {ast.unparse(n.func)}, whose parameter is "
                        f"annotated as a tensor, {at}"
                    ),
                )

    def _annotated_tensor(self, call: ast.Call, where: int | str) -> bool:
        """Is the parameter ``where`` of every function (or class) the call may reach in
        the scanned tree annotated as a tensor?"""
        if not isinstance(call.func, ast.Name):
            return False  # a method of an object the scan cannot name: not followed
        name = call.func.id
        targets: list[tuple[FunctionNode, int]] = []
        local = self.project.defs(self.source).get(name, [])
        for fn in local or [f for _, f in self.project.helpers(name)]:
            targets.append((fn, 0))
        if not targets and name[:1].isupper():
            for _, cls in self.project.classes(name):
                for stmt in cls.body:
                    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name in (
                        "__init__",
                        "__new__",
                    ):
                        targets.append((stmt, 1))
        if not targets:
            return False
        for fn, shift in targets:
            params = parameters(fn)
            if isinstance(where, int):
                positional_count = len(fn.args.posonlyargs) + len(fn.args.args)
                if where + shift >= positional_count:
                    return False
                p = params[where + shift]
            else:
                match = [p for p in params if p.arg == where]
                if not match:
                    return False
                p = match[0]
            if not tensor_annotation(p.annotation):
                return False
        return True


def _reads(flow: Flow, ctx: set[str]) -> dict[str, tuple[str, int | None]]:
    """Local name -> the ctx attribute (and tuple element) it is read from: ``x =
    ctx.a``, ``a, b = ctx.cache``, ``x = ctx.cache[1]``."""
    out: dict[str, tuple[str, int | None]] = {}
    for step in flow.steps:
        if step.how != "=" or not isinstance(step.target, ast.Name):
            continue
        value = step.value
        if step.split and step.index is not None:
            attr = attr_of(value, ctx)
            if attr is not None:
                out[step.target.id] = (attr, step.index)
            continue
        if (
            isinstance(value, ast.Subscript)
            and isinstance(value.slice, ast.Constant)
            and isinstance(value.slice.value, int)
        ):
            attr = attr_of(value.value, ctx)
            if attr is not None:
                out[step.target.id] = (attr, value.slice.value)
            continue
        attr = attr_of(value, ctx)
        if attr is not None:
            out[step.target.id] = (attr, None)
    return out


def _operands(e: ast.AST) -> list[ast.AST]:
    """The leaves of arithmetic and comparisons (``(a // 4)`` -> a, 4)."""
    if isinstance(e, ast.BinOp):
        return _operands(e.left) + _operands(e.right)
    if isinstance(e, ast.UnaryOp):
        return _operands(e.operand)
    if isinstance(e, ast.Compare):
        return [x for v in (e.left, *e.comparators) for x in _operands(v)]
    return [e]


def _number(e: ast.AST) -> bool:
    return isinstance(e, ast.Constant) and isinstance(e.value, (int, float, bool))


def kept_elements(value: ast.AST) -> list[tuple[int | None, ast.AST]]:
    """(element index, leaf) for a value kept on ctx: ``A, B, idx`` gives (0, A), (1, B),
    (2, idx); anything else is one leaf at index None."""
    if isinstance(value, ast.IfExp):  # ``x if x is not None else None``: x
        branches = [b for b in (value.body, value.orelse) if not _none(b)]
        if len(branches) == 1:
            return kept_elements(branches[0])
    if isinstance(value, (ast.Tuple, ast.List)) and not any(
        isinstance(e, ast.Starred) for e in value.elts
    ):
        return list(enumerate(value.elts))
    return [(None, value)]


def _none(e: ast.AST) -> bool:
    return isinstance(e, ast.Constant) and e.value is None
