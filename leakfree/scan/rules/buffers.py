"""LF005: a pipeline receive buffer made an autograd leaf inside a loop, its ``.grad`` read
later.

The shape (a hand-written pipeline stage)::

    for i in range(num_microbatches):
        buf = torch.empty(shape, device=device)
        dist.recv(buf, src=prev_rank)
        x = buf.requires_grad_()           # <- LF005
        inputs.append(x)
        outputs.append(stage(x))
    for i in range(num_microbatches):
        ...
        dist.send(inputs.pop(0).grad, dst=prev_rank)

Each microbatch's buffer becomes a leaf: its gradient accumulates in ``.grad``, which stays
until someone clears it, and the buffer with it, so the stage allocates (and pins) one
buffer and one gradient per microbatch; reusing the buffer instead collects tensor hooks
and gradients across steps. The fix is a non-leaf receive: ``x =
leakfree.pipeline.as_nonleaf(buf, slot)`` and ``slot.take()`` for the gradient (or a
``RecvBufferPool``), which leaves no ``.grad`` anywhere.

What counts, decided from the code only, inside one loop (``for`` / ``while``) of a
function:

- **A receive buffer**: a name bound to a tensor factory (``torch.empty`` / ``zeros`` /
  ``ones`` / ``full`` / ``*_like`` / ``new_empty`` ...) and passed to ``recv`` / ``irecv``
  (``dist.recv(buf, ...)``, ``P2POp(dist.irecv, buf, ...)``) in the same loop; or a name
  bound to a call whose name says it receives (``recv_forward(...)``,
  ``comm.receive_activation(...)``; not ``recv`` / ``irecv`` themselves, which return a
  rank or a work handle); and names bound to ``.detach()`` / ``.view()`` / ``.to()`` ...
  of those.
- **Made a leaf**: ``.requires_grad_()`` (not ``requires_grad_(False)``) or
  ``.requires_grad = True`` on it in the loop; the factory called with
  ``requires_grad=True``; a receive function that allocates its buffers so, itself or
  in a function it calls (Megatron-LM's ``recv_forward`` -> ``_communicate``, whose nested
  factory passes ``requires_grad=True``); or a helper the loop passes it to that sets
  ``requires_grad`` on its parameter (or on the items of it: ``for x in inputs:
  x.requires_grad = True``). Helpers are found by name in the scanned tree.
- **``.grad`` read later**: ``.grad`` loaded on the leaf (or its buffer), on a name drawn
  from a container it was put into (``inputs.append(x)`` then ``inputs.pop(0)`` /
  ``inputs[i]`` / ``for t in inputs``; a ``self.`` container is followed into the class's
  other methods), or inside a helper it is passed to (a function of that name in the
  scanned tree whose parameter's ``.grad`` is read, also through a local alias:
  ``backward_func = backward_step`` or ``partial(backward_step, ...)``). Without a
  ``.grad`` read the buffer is only an input (``torch.autograd.grad(..., inputs=x)``
  leaves no ``.grad``).

A buffer made a leaf once, outside any loop, is not this shape (it is one buffer, not one
per microbatch), and neither is a leaf that never came from a receive.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

from leakfree.scan._flow import Flow
from leakfree.scan._model import Project, ScanFinding, ScanRule, Source
from leakfree.scan._syntax import functions, own_nodes, tail, walk
from leakfree.scan.rules._buffer_reads import (
    FACTORIES,
    Helpers,
    base_name,
    made_leaf,
    true,
)

__all__ = ["RULES"]

CODE = "LF005"
CONFIRM = "leakfree.diagnostics.find_retained"

_FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef
_Loop = ast.For | ast.AsyncFor | ast.While

_RECV = frozenset({"recv", "irecv"})
#: calls with "recv" in their name that do not return a received tensor
_NOT_RECEIVED = frozenset({"recv", "irecv", "batch_isend_irecv", "isend_irecv", "recv_object_list"})
#: receive-named calls whose result is not a tensor
_NOT_TENSOR_SUFFIXES = ("ops", "_op", "info", "infos", "work", "works", "handle", "handles", "meta")
#: container methods that put the leaf in
_PUTS = frozenset({"append", "insert", "extend", "appendleft"})

MESSAGE = (
    "a received buffer is made an autograd leaf in a loop and its .grad read: each "
    "microbatch's gradient accumulates in .grad and pins a buffer until someone clears "
    "it; receive as a non-leaf with leakfree.pipeline.as_nonleaf(buf, slot) and take the "
    "gradient from slot.take()"
)


def _receives(fname: str) -> bool:
    """A call named for receiving a tensor (``recv_forward``), not ops, metadata or work
    handles (``get_fwd_recv_ops``, ``recv_info``) nor ``recv`` itself (it returns a rank)."""
    low = fname.lower()
    if "recv" not in low and "receive" not in low:
        return False
    return fname not in _NOT_RECEIVED and not low.endswith(_NOT_TENSOR_SUFFIXES)


def _receive_call(call: ast.Call) -> bool:
    name = tail(call.func)
    return name in _RECV or name == "P2POp" or _receives(name)


def _received_in(loop: _Loop, helpers: Helpers) -> tuple[set[str], dict[str, ast.AST]]:
    """Names bound to receive buffers in ``loop``, and the calls that made any of them
    leaves: a factory with ``requires_grad=True``, or a receive helper that makes its
    buffers so (Megatron-LM's ``recv_forward`` -> ``_communicate``)."""
    nodes = list(own_nodes(loop))
    recv_args: set[str] = set()
    for node in nodes:
        if not isinstance(node, ast.Call):
            continue
        name = tail(node.func)
        if name in _RECV:
            args = [*node.args[:1], *(k.value for k in node.keywords if k.arg == "tensor")]
        elif name == "P2POp" and node.args and tail(node.args[0]) in _RECV:
            args = node.args[1:2]
        else:
            continue
        recv_args.update(a.id for a in args if isinstance(a, ast.Name))
    received: set[str] = set()
    born_leaf: dict[str, ast.AST] = {}
    for name, value, _node in Flow(loop).assigned():
        if not isinstance(value, ast.Call):
            continue
        fname = tail(value.func)
        if fname in FACTORIES and name in recv_args:
            received.add(name)
            for kw in value.keywords:
                if kw.arg == "requires_grad" and true(kw.value):
                    born_leaf[name] = value
        elif _receives(fname):
            received.add(name)
            if helpers.receive_makes_leaf(fname):
                born_leaf[name] = value
        elif base_name(value) in received:
            received.add(name)
    return received, born_leaf


def _leaf_sites(
    loop: _Loop, received: set[str], helpers: Helpers
) -> list[tuple[ast.AST, str, set[str]]]:
    """(node, buffer name, its leaf aliases) where a received buffer is made a leaf: in the
    loop itself, or by a helper the loop passes it to (``forward_step(..., x)`` whose body
    sets ``x.requires_grad = True``)."""
    nodes = list(own_nodes(loop))
    sites: list[tuple[ast.AST, str, set[str]]] = []
    made: dict[int, set[str]] = {}
    for node in nodes:
        base = made_leaf(node, received)
        if base is not None:
            made[id(node)] = {base}
            sites.append((node, base, made[id(node)]))
        elif isinstance(node, ast.Call):
            method = isinstance(node.func, ast.Attribute)
            for i, arg in enumerate(node.args):
                base = base_name(arg)
                if base in received and helpers.makes_leaf(tail(node.func), i, method):
                    sites.append((node, base, {base}))
                    break
    # ``x = buf.requires_grad_()``: x is the leaf too
    for name, value, _node in Flow(loop).assigned():
        for sub in walk(value):
            if id(sub) in made:
                made[id(sub)].add(name)
    return sites


def check(source: Source, project: Project) -> Iterable[ScanFinding]:
    # a receive happens in this file (the leaf may be made by a helper elsewhere): a
    # cheap prefilter on the text
    text = source.text
    if "recv" not in text and "receive" not in text:
        return []
    reads = Helpers(source, project)
    found: dict[tuple[int, int], ScanFinding] = {}
    for fn, cls in functions(source.tree):
        own = list(own_nodes(fn))
        if not any(isinstance(n, ast.Call) and _receive_call(n) for n in own):
            continue  # nothing received here: skip the walks over its loops
        loops = [n for n in own if isinstance(n, (ast.For, ast.AsyncFor, ast.While))]
        for loop in loops:
            received, born_leaf = _received_in(loop, reads)
            if not received:
                continue
            sites = _leaf_sites(loop, received, reads)
            sites += [(call, name, {name}) for name, call in born_leaf.items()]
            sites.sort(
                key=lambda site: (getattr(site[0], "lineno", 0), getattr(site[0], "col_offset", 0))
            )
            seen: set[str] = set()  # one finding per buffer and loop: its first leaf site
            for node, name, aliases in sites:
                key = (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))
                if name in seen or key in found or not reads.read(fn, cls, aliases):
                    continue
                seen.add(name)
                leaf = sorted(aliases - {name})[0] if aliases - {name} else name
                found[key] = source.finding(node, CODE, f"{leaf}.grad", MESSAGE)
    return sorted(found.values())


RULES: tuple[ScanRule, ...] = (
    ScanRule(
        code=CODE,
        name="leaf-receive-buffer",
        summary=(
            "a received buffer is made a requires-grad leaf inside a loop and its .grad "
            "read: one pinned buffer and gradient per microbatch"
        ),
        confirm=CONFIRM,
        check=check,
        needs=("requires_grad",),
        fix=(
            "receive as a non-leaf with leakfree.pipeline.as_nonleaf(buf, slot) and take "
            "the gradient with slot.take()"
        ),
    ),
)
