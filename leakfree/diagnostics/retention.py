"""Who still holds tensors after a backward.

:func:`find_retained` walks from the objects you give it (by default, the caller's local
variables) through containers, attributes and class attributes. Every tensor it meets
that still carries a ``grad_fn`` leads into an autograd graph, which it walks too. It
reports:

* **graphs already backpropagated, still held**: the path of the container entry holding
  the tensor (``context.losses['lm'][3]``) and the bytes that graph still pins: the
  tensor, its Functions' ctx state, and the leaves it reaches (``AccumulateGrad``) with
  their ``.grad``, except what lives anyway (below);
* **ctx attributes of custom Functions whose backward already ran**: the Function, the
  attribute and its bytes (tensors found directly, in containers, or inside plain objects
  such as Transformer Engine's storage objects), except what lives anyway;
* **detached tensors held in growable containers** (:attr:`RetentionReport.detached`):
  tensors without a graph in a list, deque, set or a dict with non-string keys
  (``model.history``), per holder, with their count and bytes. No graph is kept there, but
  a holder that grows every step is a leak all the same.

"Lives anyway" (never charged to a graph or a ctx): parameters (``nn.Parameter`` and its
subclasses, such as bitsandbytes' ``Params4bit``), views of them, and the tensors hanging
off them (a 4-bit weight's ``quant_state``), and every tensor the walk reaches from the
roots outside a graph (it has a holder of its own: a module's buffers, a local). Each
storage is counted once per report.

A node's backward "already ran" when its saved tensors were freed (PyTorch frees them after
the node's backward unless the graph is retained); leakfree's released-state marker
counts too. Debug tool: it walks Python objects, so it costs milliseconds, not
microseconds.
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction

from leakfree._text import format_bytes, format_table
from leakfree._walk import Located, object_fields, walk
from leakfree.function import RELEASED, backward_ran

__all__ = ["Retained", "RetentionReport", "find_retained", "tensor_bytes"]

_MAX_NODES = 20000  #: per graph
_MAX_TOTAL_NODES = 200000  #: per call, over all graphs
_ROWS = 20


@dataclass(frozen=True)
class Retained:
    """One holder of memory that should have been released."""

    #: "graph" (a backpropagated graph still held), "ctx attribute", or "detached" (tensors
    #: without a graph in a growable container)
    kind: str
    where: str  #: a path like ``context.losses['lm'][3]``, or ``Function.ctx.attr``
    nbytes: int
    detail: str = ""
    count: int = 0  #: for "detached": how many tensors the holder holds


@dataclass
class RetentionReport:
    """What :func:`find_retained` found; ``str()`` is a table, biggest first.

    Iterating, ``len()`` and truth cover ``items``: graphs and ctx state that backward
    should have let go. ``detached`` lists growable containers of tensors without a graph
    (one report cannot tell whether they grow; a :class:`MemoryTracker` can).
    """

    items: list[Retained] = field(default_factory=list)
    detached: list[Retained] = field(default_factory=list)

    def __iter__(self) -> Iterator[Retained]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)

    @property
    def total_bytes(self) -> int:
        """Bytes of ctx state kept after backward (graph entries overlap these)."""
        return sum(i.nbytes for i in self.items if i.kind == "ctx attribute")

    @property
    def detached_bytes(self) -> int:
        """Bytes of tensors without a graph held in growable containers."""
        return sum(i.nbytes for i in self.detached)

    def __str__(self) -> str:
        parts = []
        if self.items:
            parts.append(_table(self.items))
        else:
            parts.append(
                "nothing retained: no backpropagated graph or released-too-late ctx state found"
            )
        if self.detached:
            top = max(self.detached, key=lambda i: i.nbytes)
            lead = "no graph kept; " if not self.items else ""
            parts.append(
                f"{lead}{format_bytes(self.detached_bytes)} of tensors without a graph held in "
                f"{len(self.detached)} growable container(s), the largest {top.where} "
                f"({format_bytes(top.nbytes)}); a leak if they grow every step:\n"
                + _table(self.detached)
            )
        return "\n\n".join(parts)


def _table(items: list[Retained]) -> str:
    rows = []
    ordered = sorted(items, key=lambda i: -i.nbytes)
    for i in ordered[:_ROWS]:
        rows.append((i.kind, i.where, format_bytes(i.nbytes), i.detail))
    if len(ordered) > _ROWS:
        rest = ordered[_ROWS:]
        rows.append(("...", f"{len(rest)} more", format_bytes(sum(i.nbytes for i in rest)), ""))
    return format_table(("kind", "where", "bytes", "detail"), rows)


def _key(tensor: torch.Tensor) -> int | None:
    """The storage's identity, or None for tensors without one (sparse, meta...)."""
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        return None
    return int(tensor.untyped_storage()._cdata)


def _parameter_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """The parameter ``tensor`` is, or is a view of (``B.view(-1, 1)`` of a 4-bit weight)."""
    if isinstance(tensor, torch.nn.Parameter):
        return tensor
    base = tensor._base
    return base if isinstance(base, torch.nn.Parameter) else None


def _adopt(param: torch.Tensor, anyway: set[int]) -> None:
    """Mark a parameter's storage, and those of the tensors hanging off it, as living."""
    key = _key(param)
    if key is None or key in anyway:
        return
    anyway.add(key)
    for t, _ in walk(object_fields(param), depth=4):
        k = _key(t)
        if k is not None:
            anyway.add(k)


def tensor_bytes(
    value: Any, seen: set[int] | None = None, depth: int = 3, *, anyway: set[int] | None = None
) -> int:
    """Bytes of the tensor storages reachable from ``value`` (``depth`` references deep,
    modules included), each storage counted once across calls sharing ``seen``.

    Parameters, views of them and what hangs off them are not counted: they live anyway.
    Nor are storages in ``anyway`` (which parameters met here are added to).
    """
    seen = set() if seen is None else seen
    anyway = set() if anyway is None else anyway
    found = []
    for tensor, _ in walk(value, depth=depth, modules=True):
        param = _parameter_of(tensor)
        if param is not None:
            _adopt(param, anyway)
        else:
            found.append(tensor)
    total = 0
    for tensor in found:
        key = _key(tensor)
        if key is None or key in anyway or key in seen:
            continue
        seen.add(key)
        total += int(tensor.untyped_storage().nbytes())
    return total


def _graph(root: Any, budget: list[int]) -> Iterator[Any]:
    seen: set[int] = set()
    stack = [root]
    while stack and len(seen) < _MAX_NODES and budget[0] > 0:
        budget[0] -= 1
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(fn for fn, _ in getattr(node, "next_functions", ()))


def _ctx_state(node: BackwardCFunction, seen: set[int], anyway: set[int]) -> list[tuple[str, int]]:
    state = [(k, v) for k, v in node.__dict__.items() if k != RELEASED]
    # Parameters first, wherever they sit: a quantized weight's state (``ctx.state``) is
    # only known to live anyway once its weight (``ctx.tensors``) was seen.
    for _, value in state:
        for tensor, _ in walk(value, depth=3, modules=True):
            param = _parameter_of(tensor)
            if param is not None:
                _adopt(param, anyway)
    out = []
    for name, value in state:
        nbytes = tensor_bytes(value, seen, anyway=anyway)
        if nbytes:
            out.append((name, nbytes))
    return out


def _leaf_bytes(node: Any, seen: set[int], anyway: set[int]) -> int:
    """What an ``AccumulateGrad`` node keeps: its leaf and the leaf's ``.grad``, unless
    the leaf lives anyway (a parameter, or held outside the graph)."""
    leaf = getattr(node, "variable", None)
    if not isinstance(leaf, torch.Tensor) or _parameter_of(leaf) is not None:
        return 0
    key = _key(leaf)
    if key is None or key in anyway:
        return 0
    total = 0
    for t in (leaf, leaf.grad):
        if t is None:
            continue
        k = _key(t)
        if k is not None and k not in seen and k not in anyway:
            seen.add(k)
            total += int(t.untyped_storage().nbytes())
    return total


def _growable(obj: Any) -> bool:
    """A container a loop can append to: a list, deque or set, or a dict keyed by
    something other than names (``history[step]``); not per-tensor state (a dict keyed by
    parameters, like an optimizer's)."""
    if isinstance(obj, (list, collections.deque, set)):
        return True
    if isinstance(obj, dict):
        keys = list(obj)
        return any(not isinstance(k, str) for k in keys) and not any(
            isinstance(k, torch.Tensor) for k in keys
        )
    return False


_LIVES_WITH_MODEL = (torch.nn.Module, torch.optim.Optimizer, torch.Tensor)


def _holder(located: Located) -> tuple[int, Located, int] | None:
    """The nearest growable container holding a detached tensor, or None when the tensor
    is model or optimizer state (a module, an optimizer or a tensor comes first)."""
    holders = located.holders()
    if any(isinstance(obj, torch.optim.Optimizer) for obj, _ in holders):
        return None
    for depth, (obj, _) in enumerate(holders):
        if isinstance(obj, _LIVES_WITH_MODEL):
            return None
        if _growable(obj):
            return id(obj), located, depth
    return None


def find_retained(
    *roots: Any,
    names: list[str] | None = None,
    depth: int = 8,
    since: RetentionReport | None = None,
) -> RetentionReport:
    """List what still holds memory that backward should have let go.

    Args:
        roots: objects to walk from (a trainer, a batch context, a module...). With none,
            the caller's local variables are the roots, named by their variable names.
        names: the names used for ``roots`` in reported paths (default ``root0``, ...).
        depth: how many containers / attributes deep to walk from a root.
        since: an earlier report over the same roots: each detached holder then says how
            much it grew since (``+3 tensors, +12.0 KiB since the last report``).

    Tensors with a ``grad_fn`` whose graph contains a node whose backward already ran are
    reported as ``graph`` entries with the bytes that graph still pins (the tensor, ctx
    state, and leaves reached through ``AccumulateGrad`` with their ``.grad``); every such
    node's ctx attributes holding tensors are reported as ``ctx attribute``. Tensors
    without a graph in growable containers are listed in ``detached``, per holder.
    Parameters and tensors held outside a graph live anyway and are charged to neither.
    """
    if roots:
        named = list(zip(names or [f"root{i}" for i in range(len(roots))], roots))
    else:
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        named = list(caller.f_locals.items()) if caller is not None else []
        del frame, caller
    # 1. Every tensor the roots hold. What they hold outside a graph lives anyway.
    visited: set[int] = set()
    anyway: set[int] = set()
    found: list[tuple[str, torch.Tensor, Located]] = []
    for name, root in named:
        for tensor, located in walk(root, depth=depth, modules=True, visited=visited, classes=True):
            found.append((name, tensor, located))
            param = _parameter_of(tensor)
            if param is not None:
                _adopt(param, anyway)
            elif tensor.grad_fn is None:
                key = _key(tensor)
                if key is not None:
                    anyway.add(key)
    # 2. The graphs behind tensors with a grad_fn; the holders of those without one.
    graphs: list[Retained] = []
    ctx_bytes: dict[str, int] = {}
    ctx_nodes: dict[str, int] = {}
    nodes_seen: set[int] = set()
    counted: set[int] = set()
    released_cache: dict[int, bool] = {}
    budget = [_MAX_TOTAL_NODES]
    holders: dict[int, tuple[str, Located, int, list[torch.Tensor]]] = {}
    for name, tensor, located in found:
        if tensor.grad_fn is None:
            if _parameter_of(tensor) is None:
                held = _holder(located)
                if held is not None:
                    entry = holders.setdefault(held[0], (name, held[1], held[2], []))
                    entry[3].append(tensor)
            continue
        graph_bytes = 0
        backpropagated = False
        nodes = 0
        leaves = []
        for node in _graph(tensor.grad_fn, budget):
            nodes += 1
            released = released_cache.get(id(node))
            if released is None:
                released = released_cache[id(node)] = backward_ran(node)
            backpropagated = backpropagated or released
            if hasattr(node, "variable"):
                leaves.append(node)
            if isinstance(node, BackwardCFunction) and released:
                state = _ctx_state(node, counted, anyway)
                graph_bytes += sum(n for _, n in state)
                if id(node) not in nodes_seen:
                    nodes_seen.add(id(node))
                    cls = node._forward_cls.__qualname__  # type: ignore[attr-defined]
                    for attr, nbytes in state:
                        where = f"{cls}.ctx.{attr}"
                        ctx_bytes[where] = ctx_bytes.get(where, 0) + nbytes
                        ctx_nodes[where] = ctx_nodes.get(where, 0) + 1
        if backpropagated:
            leaf_bytes = sum(_leaf_bytes(node, counted, anyway) for node in leaves)
            graph_bytes += leaf_bytes + tensor_bytes(tensor, counted, depth=0)
            pinned = f", {format_bytes(leaf_bytes)} of leaves and their .grad" if leaf_bytes else ""
            graphs.append(
                Retained(
                    "graph",
                    located.named(name),
                    graph_bytes,
                    f"a tensor whose graph was already backpropagated ({nodes} nodes{pinned}); "
                    "detach it before keeping it",
                )
            )
    ctx = [
        Retained(
            "ctx attribute",
            where,
            nbytes,
            f"{ctx_nodes[where]} node(s) kept it after their backward ran",
        )
        for where, nbytes in ctx_bytes.items()
    ]
    return RetentionReport(ctx + graphs, _detached(holders, since))


def _detached(
    holders: dict[int, tuple[str, Located, int, list[torch.Tensor]]],
    since: RetentionReport | None,
) -> list[Retained]:
    before = {r.where: r for r in since.detached} if since is not None else {}
    out = []
    seen: set[int] = set()
    for name, located, up, tensors in holders.values():
        nbytes = 0
        for t in tensors:
            key = _key(t)
            if key is not None and key not in seen:
                seen.add(key)
                nbytes += int(t.untyped_storage().nbytes())
        where = located.above(up).named(name)
        detail = f"{len(tensors)} tensor(s) without a graph"
        if since is not None:
            old = before.get(where)
            grew = len(tensors) - (old.count if old is not None else 0)
            more = nbytes - (old.nbytes if old is not None else 0)
            verdict = "growing" if grew > 0 or more > 0 else "not growing"
            detail += f"; {verdict}: {grew:+d} tensors, {_signed(more)} since the last report"
        out.append(Retained("detached", where, nbytes, detail, len(tensors)))
    return out


def _signed(nbytes: int) -> str:
    return ("-" if nbytes < 0 else "+") + format_bytes(abs(nbytes))
