"""Who still holds tensors after a backward.

:func:`find_retained` walks from the objects you give it (by default, the caller's local
variables) through containers and attributes. Every tensor it meets that still carries a
``grad_fn`` leads into an autograd graph, which it walks too. It reports:

* **graphs already backpropagated, still held**: the path of the container entry holding
  the tensor (``context.losses['lm'][3]``) and how many bytes that graph still pins;
* **ctx attributes of custom Functions whose backward already ran**: the Function, the
  attribute and its bytes (tensors found directly, in containers, or inside plain objects
  such as Transformer Engine's storage objects).

A node's backward "already ran" when its saved tensors were freed (PyTorch frees them after
the node's backward unless the graph is retained); leakfree's released-state marker
counts too. Debug tool: it walks Python objects, so it costs milliseconds, not
microseconds.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction

from leakfree._text import format_bytes, format_table
from leakfree._walk import walk
from leakfree.function import RELEASED, backward_ran

__all__ = ["Retained", "RetentionReport", "find_retained", "tensor_bytes"]

_MAX_NODES = 20000  #: per graph
_MAX_TOTAL_NODES = 200000  #: per call, over all graphs
_ROWS = 20


@dataclass(frozen=True)
class Retained:
    """One holder of memory that should have been released."""

    kind: str  #: "graph" (a backpropagated graph still held) or "ctx attribute"
    where: str  #: a path like ``context.losses['lm'][3]``, or ``Function.ctx.attr``
    nbytes: int
    detail: str = ""


@dataclass
class RetentionReport:
    """What :func:`find_retained` found; ``str()`` is a table, biggest first."""

    items: list[Retained] = field(default_factory=list)

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

    def __str__(self) -> str:
        if not self.items:
            return "nothing retained: no backpropagated graph or released-too-late ctx state found"
        rows = []
        ordered = sorted(self.items, key=lambda i: -i.nbytes)
        for i in ordered[:_ROWS]:
            rows.append((i.kind, i.where, format_bytes(i.nbytes), i.detail))
        if len(ordered) > _ROWS:
            rest = ordered[_ROWS:]
            rows.append(("...", f"{len(rest)} more", format_bytes(sum(i.nbytes for i in rest)), ""))
        return format_table(("kind", "where", "bytes", "detail"), rows)


def tensor_bytes(value: Any, seen: set[int] | None = None, depth: int = 3) -> int:
    """Bytes of the tensor storages reachable from ``value`` (``depth`` references deep,
    modules included), each storage counted once across calls sharing ``seen``."""
    seen = set() if seen is None else seen
    total = 0
    for tensor, _ in walk(value, depth=depth, modules=True):
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            total += int(storage.nbytes())
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


def _ctx_state(node: BackwardCFunction, seen: set[int]) -> list[tuple[str, int]]:
    out = []
    for name, value in node.__dict__.items():
        if name == RELEASED:
            continue
        nbytes = tensor_bytes(value, seen)
        if nbytes:
            out.append((name, nbytes))
    return out


def find_retained(*roots: Any, names: list[str] | None = None, depth: int = 8) -> RetentionReport:
    """List what still holds memory that backward should have let go.

    Args:
        roots: objects to walk from (a trainer, a batch context, a module...). With none,
            the caller's local variables are the roots, named by their variable names.
        names: the names used for ``roots`` in reported paths (default ``root0``, ...).
        depth: how many containers / attributes deep to walk from a root.

    Tensors with a ``grad_fn`` whose graph contains a node whose backward already ran are
    reported as ``graph`` entries with the bytes that graph still pins (its ctx state);
    every such node's ctx attributes holding tensors are reported as ``ctx attribute``.
    """
    if roots:
        named = list(zip(names or [f"root{i}" for i in range(len(roots))], roots))
    else:
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        named = list(caller.f_locals.items()) if caller is not None else []
        del frame, caller
    graphs: list[Retained] = []
    ctx_bytes: dict[str, int] = {}
    ctx_nodes: dict[str, int] = {}
    visited: set[int] = set()
    nodes_seen: set[int] = set()
    counted: set[int] = set()
    released_cache: dict[int, bool] = {}
    budget = [_MAX_TOTAL_NODES]
    for name, root in named:
        for tensor, path_of in walk(root, depth=depth, modules=True, visited=visited):
            if tensor.grad_fn is None:
                continue
            path = name + path_of()
            graph_bytes = 0
            backpropagated = False
            nodes = 0
            for node in _graph(tensor.grad_fn, budget):
                nodes += 1
                released = released_cache.get(id(node))
                if released is None:
                    released = released_cache[id(node)] = backward_ran(node)
                backpropagated = backpropagated or released
                if isinstance(node, BackwardCFunction) and released:
                    state = _ctx_state(node, counted)
                    graph_bytes += sum(n for _, n in state)
                    if id(node) not in nodes_seen:
                        nodes_seen.add(id(node))
                        cls = node._forward_cls.__qualname__  # type: ignore[attr-defined]
                        for attr, nbytes in state:
                            where = f"{cls}.ctx.{attr}"
                            ctx_bytes[where] = ctx_bytes.get(where, 0) + nbytes
                            ctx_nodes[where] = ctx_nodes.get(where, 0) + 1
            if backpropagated:
                graph_bytes += tensor_bytes(tensor, counted)
                graphs.append(
                    Retained(
                        "graph",
                        path,
                        graph_bytes,
                        f"a tensor whose graph was already backpropagated ({nodes} nodes); "
                        "detach it before keeping it",
                    )
                )
    report = RetentionReport(
        [
            Retained(
                "ctx attribute",
                where,
                nbytes,
                f"{ctx_nodes[where]} node(s) kept it after their backward ran",
            )
            for where, nbytes in ctx_bytes.items()
        ]
        + graphs
    )
    return report
