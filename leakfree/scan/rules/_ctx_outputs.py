"""LF002's question about forward: which names and ctx attributes are the node's tensor
outputs (a stored one is a reference cycle through its ``grad_fn``)?"""

from __future__ import annotations

import ast

from leakfree.scan._syntax import (
    FunctionClass,
    FunctionNode,
    attr_of,
    calls_on,
    elements,
    name_words,
    own_nodes,
    parameters,
    tail,
    words,
)
from leakfree.scan._tensors import TensorEvidence, handle_named

#: methods and attributes of a tensor that return a view of it (share its ``_base``)
_VIEWS = words(
    "view view_as reshape reshape_as transpose t permute narrow select unsqueeze squeeze "
    "expand expand_as flatten unflatten split chunk unbind tensor_split movedim swapaxes "
    "diagonal as_strided unfold real imag T mT H mH contiguous"
)

#: words naming integer or boolean outputs (indices, id maps, masks, counts): tensors that
#: never get a grad_fn, so storing them makes no cycle
_INDEX_WORDS = words("idx index indices ids id map mask masks count counts argmax argmin")
#: calls whose result is a tuple or list of tensors: as one element of forward's result it
#: is not a tensor output and gets no grad_fn
_SEQUENCES = words("chunk split unbind tensor_split hsplit vsplit dsplit list tuple")


def outputs(
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
    for call, method in calls_on(nodes, ctx, ("mark_dirty", "mark_non_differentiable")):
        target = dirty if method == "mark_dirty" else nondiff
        for a in call.args:
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
                    elif (returned := attr_of(r, ctx)) is not None:
                        attrs.add(returned)
    # unpacking and views of outputs are outputs too (a, b = output; v = out.view(...))
    changed = True
    while changed:
        changed = False
        for n in nodes:
            if isinstance(n, ast.Assign) and is_output(n.value, names):
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


def is_output(e: ast.AST, outs: set[str]) -> bool:
    """Is ``e`` an output, a view of one, or a container holding one?"""
    if isinstance(e, ast.Name):
        return e.id in outs
    if isinstance(e, ast.Subscript):
        return is_output(e.value, outs)
    if isinstance(e, ast.Attribute):
        return e.attr in _VIEWS and is_output(e.value, outs)
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute):
        return e.func.attr in _VIEWS and is_output(e.func.value, outs)
    if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
        return any(is_output(v.value if isinstance(v, ast.Starred) else v, outs) for v in e.elts)
    if isinstance(e, ast.Dict):
        return any(is_output(v, outs) for v in e.values)
    return False


def tensor_element(
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
