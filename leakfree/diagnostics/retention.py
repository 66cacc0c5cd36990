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
from leakfree._walk import SCALARS as _SCALARS
from leakfree._walk import object_fields as _object_fields
from leakfree.function import RELEASED

__all__ = ["Retained", "RetentionReport", "find_retained", "tensor_bytes"]

_MAX_NODES = 20000  #: per graph
_MAX_TOTAL_NODES = 200000  #: per call, over all graphs
_MAX_ITEMS = 100000  #: per list or tuple
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


def tensor_bytes(value: Any, seen: set[int] | None = None, depth: int = 0) -> int:
    """Bytes of the tensor storages reachable from ``value`` (containers and plain objects
    three levels deep), each storage counted once."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.device.type == "meta":
            return 0
        storage = value.untyped_storage()
        key = storage._cdata
        if key in seen:
            return 0
        seen.add(key)
        return int(storage.nbytes())
    if depth >= 3 or isinstance(value, _SCALARS):
        return 0
    if isinstance(value, dict):
        items: Any = value.values()
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        items = list(vars(value).values())
    else:
        return 0
    return sum(tensor_bytes(v, seen, depth + 1) for v in items)


_raw_names: dict[type, tuple[str, ...]] = {}


def _released(node: Any) -> bool:
    """Did this node's backward already run (in a pass that did not keep the graph)?

    Reads only ``_raw_saved_*`` handles (``SavedTensor.data`` is ``None`` once released);
    never unpacks a saved tensor, so no saved-tensor hook (an offloader's) runs.
    """
    try:
        if isinstance(node, BackwardCFunction):
            if RELEASED in node.__dict__:
                return True
            try:
                node._raw_saved_tensors  # noqa: B018
            except RuntimeError:
                return True
            return False
        names = _raw_names.get(type(node))
        if names is None:
            names = _raw_names[type(node)] = tuple(
                n for n in dir(node) if n.startswith("_raw_saved_")
            )
        handles: list[Any] = []
        for name in names:
            value = getattr(node, name)
            handles.extend(value if isinstance(value, (list, tuple)) else [value])
        saved = [h for h in handles if hasattr(h, "data")]
        return bool(saved) and all(h.data is None for h in saved)
    except Exception:  # an exotic node: say nothing rather than break the walk
        return False


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


def _walk(obj: Any, path: str, depth: int, visited: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        if obj.grad_fn is not None:
            yield path, obj
        return
    if depth <= 0 or isinstance(obj, _SCALARS) or id(obj) in visited:
        return
    if inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(obj):
        return
    visited.add(id(obj))
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            yield from _walk(v, f"{path}[{k!r}]", depth - 1, visited)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            if i >= _MAX_ITEMS:
                break
            yield from _walk(v, f"{path}[{i}]", depth - 1, visited)
    elif isinstance(obj, (set, frozenset)):
        for v in obj:
            yield from _walk(v, f"{path}{{...}}", depth - 1, visited)
    else:
        for name, v in _object_fields(obj).items():
            if not name.startswith("__"):
                yield from _walk(v, f"{path}.{name}", depth - 1, visited)


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
        for path, tensor in _walk(root, name, depth, visited):
            graph_bytes = 0
            backpropagated = False
            nodes = 0
            for node in _graph(tensor.grad_fn, budget):
                nodes += 1
                released = released_cache.get(id(node))
                if released is None:
                    released = released_cache[id(node)] = _released(node)
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
