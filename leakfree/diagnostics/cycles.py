"""Tensors held only by reference cycles: how many bytes, and the cycle that holds them.

With automatic garbage collection off (``gc.disable()``, as torchtitan's ``gc_freq`` and
many trainers do to avoid collection pauses), an object in a reference cycle lives until
the next manual ``gc.collect()``; a cycle that reaches an activation or an autograd graph
keeps it that long. With collection on, such cycles still outlive their step when they
were promoted to the oldest generation, which is collected rarely.

:func:`find_cycles` answers "what would ``gc.collect()`` free now" without freeing it: it
runs one collection with ``gc.DEBUG_SAVEALL``, so the unreachable objects go to
``gc.garbage`` instead of being freed, reads them, and takes them out of ``gc.garbage``
again. They are then exactly as before: unreachable cycles, freed at the next collection.
What a collection does before deciding (clearing weak references to those objects and
running their finalizers) happens now instead of then: nothing reachable can observe it.
Cost: one full collection (milliseconds to a second on a large heap), so watchers run it
only when they have found growth, and once after their warm-up.
"""

from __future__ import annotations

import gc
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction

from leakfree._text import format_bytes
from leakfree.diagnostics.retention import graph_bytes

__all__ = ["Cycles", "find_cycles"]

_PROXIES = (weakref.ProxyType, weakref.CallableProxyType)

#: at most this many garbage objects are read for the cycle's path
_MAX_OBJECTS = 200_000


@dataclass(frozen=True)
class Cycles:
    """What one collection would free: tensors held only by reference cycles."""

    gc_enabled: bool
    nbytes: int  #: bytes of the tensors (and what their graphs save) in the garbage
    tensors: int  #: tensors among the garbage
    objects: int  #: objects in the garbage
    path: str  #: one cycle that reaches the largest tensor, ``Node.parent -> Node...``
    site: str = ""  #: where the largest tensor was created, when known

    def __str__(self) -> str:
        if self.gc_enabled:
            head = (
                f"{format_bytes(self.nbytes)} in {self.tensors} tensor(s) survived the step "
                "in reference cycles: they are freed late, when the garbage collector next "
                "reaches the oldest generation"
            )
        else:
            head = (
                f"gc is disabled: {format_bytes(self.nbytes)} in {self.tensors} tensor(s) "
                f"sit in reference cycles ({self.objects} objects) that gc.collect() would free"
            )
        made = f"; created at {self.site}" if self.site else ""
        ctx = (
            " (a tensor kept as an attribute of a custom Function's ctx: "
            "ctx.save_for_backward keeps it without a cycle)"
            if ".ctx." in self.path
            else ""
        )
        return f"{head}; cycle: {self.path}{ctx}{made}"


def find_cycles(
    site: Callable[[torch.Tensor], Any] | None = None,
    mine: Callable[[torch.Tensor], bool] | None = None,
) -> Cycles | None:
    """The tensors a ``gc.collect()`` would free now, or None when it would free none.

    ``site(tensor)`` (optional) names where a tensor was created (a tracker's record);
    ``mine(tensor)`` (optional) keeps only the tensors it accepts (those a tracker saw
    made, so a cycle left from before the watch is not charged to it).
    """
    enabled = gc.isenabled()
    flags = gc.get_debug()
    start = len(gc.garbage)
    gc.set_debug(flags | gc.DEBUG_SAVEALL)
    try:
        gc.collect()
    finally:
        gc.set_debug(flags)
    garbage = gc.garbage[start:]
    del gc.garbage[start:]
    try:
        return _read(garbage, enabled, site, mine)
    finally:
        del garbage


def _read(
    garbage: list[Any],
    enabled: bool,
    site: Callable[[torch.Tensor], Any] | None,
    mine: Callable[[torch.Tensor], bool] | None,
) -> Cycles | None:
    # type(), not isinstance(): a dead weakref.proxy among the garbage raises on the latter
    tensors = [
        o for o in garbage if issubclass(type(o), torch.Tensor) and (mine is None or mine(o))
    ]
    if not tensors:
        return None
    counted: set[int] = set()
    sizes = []
    for t in tensors:
        sizes.append((graph_bytes(t, counted), t))
    total = sum(n for n, _ in sizes)
    if total == 0:
        return None
    top = max(n for n, _ in sizes)
    largest = [t for n, t in sizes if n == top][-1]  # the most recent of the largest
    path = _cycle_to(largest, garbage)
    made = site(largest) if site is not None else None
    return Cycles(enabled, total, len(tensors), len(garbage), path, str(made) if made else "")


def _labelled(obj: Any) -> list[tuple[str, Any]]:
    """What ``obj`` refers to, as the collector sees it, each with a readable label: an
    attribute (``.parent``), a key (``['k']``), an index (``[2]``), a closure cell."""
    names: dict[int, str] = {}
    out: list[tuple[str, Any]] = []
    fields = None
    if isinstance(obj, dict):
        names = {id(v): f"[{k!r}]" for k, v in list(obj.items())}
    elif isinstance(obj, (list, tuple)):
        names = {id(v): f"[{i}]" for i, v in enumerate(obj)}
    elif isinstance(obj, types.CellType):
        names = {id(v): ".cell_contents" for v in gc.get_referents(obj)}
    elif not isinstance(obj, type):
        try:
            fields = object.__getattribute__(obj, "__dict__")
        except AttributeError:
            fields = None
        if isinstance(fields, dict):  # attributes by name, not through the dict
            out = [(f".{k}", v) for k, v in list(fields.items())]
        if isinstance(obj, types.FunctionType):
            names = {id(c): "<closure>" for c in obj.__closure__ or ()}
        elif isinstance(obj, torch.Tensor) and obj.grad_fn is not None:
            names = {id(obj.grad_fn): ".grad_fn"}
    for child in gc.get_referents(obj):
        if type(child) in _PROXIES or isinstance(child, type) or child is fields:
            continue
        out.append((names.get(id(child), " ->"), child))
    return out


def _name(obj: Any) -> str:
    """A type's name; a custom Function's node as the Function's ctx (``Restraint.ctx``):
    its attributes are what ``forward`` set on ``ctx``."""
    if isinstance(obj, BackwardCFunction):
        forward = getattr(obj, "_forward_cls", None)
        if forward is not None:
            return f"{forward.__qualname__}.ctx"
    return type(obj).__qualname__


def _cycle_to(target: Any, garbage: list[Any]) -> str:
    """One cycle among ``garbage`` from which ``target`` is reachable, as
    ``Type.label -> Type.label -> ...``, then the way down to ``target``."""
    members = {id(o): o for o in garbage[:_MAX_OBJECTS] if type(o) not in _PROXIES}
    edges: dict[int, list[tuple[str, Any]]] = {}
    for key, obj in members.items():
        edges[key] = [(lab, c) for lab, c in _labelled(obj) if id(c) in members]
    # The target's holders, nearest first (a reverse breadth-first search); the first
    # that lies on a cycle names it: the cycle that keeps this tensor, not any other.
    parents: dict[int, list[int]] = {}
    for key, out in edges.items():
        for _, child in out:
            parents.setdefault(id(child), []).append(key)
    order: list[int] = []
    seen = {id(target)}
    frontier = [id(target)]
    while frontier and len(order) < 1000:
        nxt = []
        for key in frontier:
            for parent in parents.get(key, ()):
                if parent not in seen:
                    seen.add(parent)
                    order.append(parent)
                    nxt.append(parent)
        frontier = nxt
    # Frames last: a traceback kept in a cycle holds every frame of its stack, and with
    # them every local; a cycle of the user's own objects says more.
    plain = {
        k: [(lab, c) for lab, c in out if not isinstance(c, types.FrameType)]
        for k, out in edges.items()
        if not isinstance(members[k], types.FrameType)
    }
    for holder, graph in [(h, plain) for h in order] + [(h, edges) for h in order]:
        loop = _cycle_through(holder, graph)
        if loop:
            way = _path_down(members[holder], target, edges)
            text = " -> ".join(f"{_name(members[k])}{label}" for k, label in loop)
            return f"{text} -> {_name(members[holder])}" + (f"; holds it by {way}" if way else "")
    return f"{_name(target)} (no cycle path found among {len(members)} objects)"


def _cycle_through(start: int, edges: dict[int, list[tuple[str, Any]]]) -> list[tuple[int, str]]:
    """The shortest way from ``start`` back to itself, as ``(object id, label)`` steps."""
    back: dict[int, tuple[int, str]] = {}
    frontier = [start]
    for _ in range(32):
        nxt = []
        for key in frontier:
            for label, child in edges.get(key, ()):
                c = id(child)
                if c == start:
                    steps = [(key, label)]
                    while key != start:
                        key, label = back[key]
                        steps.append((key, label))
                    return steps[::-1]
                if c not in back:
                    back[c] = (key, label)
                    nxt.append(c)
        frontier = nxt
    return []


def _path_down(start: Any, target: Any, edges: dict[int, list[tuple[str, Any]]]) -> str:
    """The labels from ``start`` down to ``target`` (breadth-first), e.g. ``.out``."""
    frontier: list[tuple[int, str]] = [(id(start), "")]
    seen = {id(start)}
    for _ in range(16):
        nxt = []
        for key, labels in frontier:
            if key == id(target):
                return labels
            for label, child in edges.get(key, []):
                if id(child) not in seen:
                    seen.add(id(child))
                    nxt.append((id(child), labels + label))
        frontier = nxt
    return ""
