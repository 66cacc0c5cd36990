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
  (``model.history``), per holder, with their count and bytes; named down to the field of
  the container's items that holds them (``dataset.utterances[*].features``), and, for an
  attribute set on a module, by what set it (a forward hook). No graph is kept there, but
  a holder that grows every step is a leak all the same.

Every holder of a tensor is named: a tensor two holders keep is listed under each (a
graph's bytes counted once, each entry saying what it pins).

Quiet by default: a backpropagated graph is reported when a growable container holds it
(a list, a deque, a set, a dict keyed by numbers, a tensor's hook table) or, backpropagated
with ``retain_graph=True``, when anything does; ctx state always; detached holders only when
they grew since an earlier report (``since``). A single backpropagated graph in a name or
an attribute (the last iteration's ``loss``), graphs not backpropagated yet and the user's
own batches are what a clean loop holds: ``everything=True`` lists them too.

Each entry names where its tensor was created (``created at train.py:42 in compute``)
when a :class:`~leakfree.diagnostics.MemoryTracker` (or a watcher built on one) saw it
made: see :mod:`leakfree.diagnostics.sites`.

"Lives anyway" (never charged to a graph or a ctx): parameters (``nn.Parameter`` and its
subclasses, such as bitsandbytes' ``Params4bit``), views of them, and the tensors hanging
off them (a 4-bit weight's ``quant_state``), and every tensor the walk reaches from the
roots outside a graph (it has a holder of its own: a module's buffers, a local). Each
storage is counted once per report.

A node's backward "already ran" when its saved tensors were freed (PyTorch frees them after
the node's backward unless the graph is retained); leakfree's released-state marker
counts too, and so does the mark :mod:`~leakfree.diagnostics.boundaries` leaves on a graph
backpropagated with ``retain_graph=True`` while a watcher runs (such a graph's saved
tensors are alive, and are counted). Debug tool: it walks Python objects, so it costs
milliseconds, not microseconds.
"""

from __future__ import annotations

import collections
import inspect
import re
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction

import leakfree._args as _args
from leakfree._nodes import RELEASED, backward_ran, saved_handles
from leakfree._text import format_bytes, format_table
from leakfree._walk import Located, frame_locals, object_fields, walk
from leakfree.diagnostics.boundaries import RETAINED
from leakfree.diagnostics.sites import active_site

__all__ = [
    "Retained",
    "RetentionReport",
    "by_holder",
    "find_retained",
    "graph_bytes",
    "holder_key",
    "tensor_bytes",
]

#: names a tensor's creation site, or None (a tracker's ``site``)
SiteOf = Callable[[torch.Tensor], object]

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
    site: str = ""  #: where the held tensor was created (``train.py:42 in compute``), if known
    #: for "graph": the bytes kept through the graph alone, beyond the held tensor's own
    #: storage (what detaching it would free)
    through_graph: int = 0
    #: how many of the held tensors are floating-point values of more than one element
    #: (what a forward computes), not scalars (a logged loss) or integer ids and masks
    floating: int = 0
    #: for "graph": the autograd nodes its graph keeps (host memory, whatever it saved)
    nodes: int = 0
    #: listed without ``everything=True``: not what a clean loop holds too
    listed: bool = True
    #: how the holder came to hold it, where that is known (``set on each Softmax module by
    #: the forward hook Explainer._keep_io...``)
    note: str = ""
    #: for "graph": weak references to the held tensors (keeping nothing alive), so a later
    #: search can tell the same tensors under another holder
    held: tuple[weakref.ref[torch.Tensor], ...] = field(default=(), compare=False, repr=False)

    def __str__(self) -> str:
        made = f"  created at {self.site}" if self.site else ""
        note = f", {self.note}" if self.note else ""
        return f"{self.where}  {self.kind}, {format_bytes(self.nbytes)}{note}{made}"

    def as_dict(self) -> dict[str, Any]:
        """The holder as plain data (a report's ``--json``)."""
        return {
            "where": self.where,
            "kind": self.kind,
            "bytes": self.nbytes,
            "count": self.count,
            "created_at": self.site,
            "note": self.note,
        }


@dataclass
class RetentionReport:
    """What :func:`find_retained` found; ``str()`` is a table, biggest first.

    Iterating, ``len()`` and truth cover ``items``: graphs and ctx state that backward
    should have let go. ``detached`` lists growable containers of tensors without a graph
    (one report cannot tell whether they grow; a :class:`MemoryTracker` can).
    """

    items: list[Retained] = field(default_factory=list)
    detached: list[Retained] = field(default_factory=list)
    #: every detached holder seen, shown or not: what a later ``since=`` compares against
    all_detached: list[Retained] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.all_detached:
            self.all_detached = list(self.detached)

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


_INDEX = re.compile(r"\[-?\d+\]")
#: an attribute or a string key along a path (``.features``, ``['state']``)
_FIELD = re.compile(r"\.\w|\['")


def holder_key(item: Retained) -> tuple[str, str]:
    """An entry's holder, the same across searches and entries: its kind and its path with
    indices as ``[*]`` (``output_lst[*]['entropy']``)."""
    return item.kind, _INDEX.sub("[*]", item.where)


def group(items: list[Retained]) -> list[Retained]:
    """Entries that differ only in their indices (``output_lst[0]['entropy']``,
    ``output_lst[1]['entropy']``...) and share a kind, as one entry
    (``output_lst[*]['entropy']``, ``count`` of them), biggest first."""
    groups: dict[tuple[str, str], list[Retained]] = {}
    for item in items:
        groups.setdefault(holder_key(item), []).append(item)
    out = []
    for (kind, where), members in groups.items():
        if len(members) == 1:
            out.append(members[0])
            continue
        # The most frequent site (a sampling tracker saw only some of them made).
        sites = [m.site for m in members if m.site]
        site = max(set(sites), key=sites.count) if sites else ""
        count = sum(max(m.count, 1) for m in members)
        detail = f"{len(members)} of them; each {members[0].detail}"
        nbytes = sum(m.nbytes for m in members)
        through = sum(m.through_graph for m in members)
        floating = sum(m.floating for m in members)
        nodes = sum(m.nodes for m in members)
        listed = any(m.listed for m in members)
        note = next((m.note for m in members if m.note), "")
        held = tuple(ref for m in members for ref in m.held)
        out.append(
            Retained(
                kind,
                where,
                nbytes,
                detail,
                count,
                site,
                through,
                floating,
                nodes,
                listed,
                note,
                held,
            )
        )
    return sorted(out, key=lambda i: -i.nbytes)


def by_holder(items: list[Retained]) -> dict[tuple[str, str], Retained]:
    """``items`` grouped (:func:`group`), by holder (:func:`holder_key`): what a search
    found, to compare with another search's."""
    return {holder_key(h): h for h in group(items)}


def _table(items: list[Retained]) -> str:
    rows = []
    ordered = group(items)
    for i in ordered[:_ROWS]:
        detail = f"{i.detail}; {i.note}" if i.note else i.detail
        rows.append((i.kind, i.where, format_bytes(i.nbytes), i.site or "?", detail))
    if len(ordered) > _ROWS:
        rest = ordered[_ROWS:]
        rows.append(("...", f"{len(rest)} more", format_bytes(sum(i.nbytes for i in rest)), "", ""))
    return format_table(("kind", "where", "bytes", "created at", "detail"), rows)


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


def _holder(located: Located) -> tuple[int, Located, int] | None:
    """The nearest growable container holding a detached tensor, or None when the tensor
    is optimizer state, a tensor's (hangs off another tensor) or model state (a module
    comes first and no growable container holds that module: a module kept in a list,
    say an explainer's made per step, keeps what was set on it)."""
    holders = located.holders()
    if any(isinstance(obj, torch.optim.Optimizer) for obj, _ in holders):
        return None
    for depth, (obj, _) in enumerate(holders):
        if isinstance(obj, torch.Tensor):
            return None
        if _growable(obj):
            return id(obj), located, depth
    return None


def _marked(node: Any) -> bool:
    """Backpropagated with ``retain_graph=True`` while a watcher ran (its saved tensors are
    alive)."""
    try:
        return RETAINED in node.metadata
    except (AttributeError, RuntimeError):
        return False


def _saved(node: Any) -> list[Any]:
    """What a node saved for its backward, where it is still alive: the tensors, or what a
    saved-tensor hook packed them into (an offloader's host copy). Read through the raw
    handles' ``data``, so no unpack hook runs."""
    try:
        handles = saved_handles(node)
    except RuntimeError:  # a custom Function's, released after its backward
        return []
    out = []
    for handle in handles:
        try:
            out.append(handle.data)
        except (AttributeError, RuntimeError):  # freed, or a torch without .data
            continue
    return out


def graph_bytes(tensor: torch.Tensor, counted: set[int] | None = None) -> int:
    """Bytes ``tensor`` keeps alive through itself and its graph: its storage, what the
    graph's nodes saved (while alive) and custom Functions' ctx state; parameters and
    storages already in ``counted`` excluded (it is updated)."""
    counted = set() if counted is None else counted
    anyway: set[int] = set()
    total = tensor_bytes(tensor, counted, depth=0, anyway=anyway)
    for node in _graph(tensor.grad_fn, [_MAX_NODES]):
        total += tensor_bytes(_saved(node), counted, depth=2, anyway=anyway)
        if isinstance(node, BackwardCFunction):
            total += sum(n for _, n in _ctx_state(node, counted, anyway))
    return total


def _in_growable(located: Located) -> bool:
    return any(_growable(obj) for obj, _ in located.holders())


def find_retained(
    *roots: Any,
    names: list[str] | None = None,
    depth: int = 8,
    since: RetentionReport | None = None,
    everything: bool = False,
    sites: SiteOf | None = None,
) -> RetentionReport:
    """List what still holds memory that backward should have let go.

    Args:
        roots: objects to walk from (a trainer, a batch context, a module...). With none,
            the caller's local variables are the roots, named by their variable names.
        names: the names used for ``roots`` in reported paths (default ``root0``, ...).
        depth: how many containers / attributes deep to walk from a root.
        since: an earlier report over the same roots: each detached holder then says how
            much it grew since (``+3 tensors, +12.0 KiB since the last report``), and only
            growing ones are listed.
        everything: also list what a clean loop holds (see the module doc): single
            backpropagated graphs held by a name or an attribute, and every growable
            container of detached tensors.
        sites: names where a tensor was created (default: the active trackers' records).

    Tensors with a ``grad_fn`` whose graph contains a node whose backward already ran are
    reported as ``graph`` entries with the bytes that graph still pins (the tensor, ctx
    state, saved tensors of a graph kept by ``retain_graph=True``, and leaves reached
    through ``AccumulateGrad`` with their ``.grad``); every such node's ctx attributes
    holding tensors are reported as ``ctx attribute``. Tensors without a graph in growable
    containers are listed in ``detached``, per holder. Parameters and tensors held outside
    a graph live anyway and are charged to neither.
    """
    call = "find_retained"
    if names is not None:
        names = _args.items(call, "names", names, (str,), "str")
    _args.count(call, "depth", depth, 0)
    if since is not None and not isinstance(since, RetentionReport):
        raise _args.refuse(call, "since", since, "None or an earlier RetentionReport")
    _args.flag(call, "everything", everything)
    _args.function(call, "sites", sites, none=True)
    if roots:
        named = list(zip(names or [f"root{i}" for i in range(len(roots))], roots))
    else:
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        named = frame_locals(caller) if caller is not None else []
        del frame, caller
    site_of = sites if sites is not None else active_site

    def made(tensor: torch.Tensor) -> str:
        found = site_of(tensor) if site_of is not None else None
        return "" if found is None else str(found)

    found, anyway = _reach(named, depth)
    graphs = _Graphs(anyway, made)
    kept = [g for g in (graphs.judge(*f, everything) for f in found if f[1].grad_fn) if g]
    every, shown = _detached(_holders(found), since, made, everything, site_of)
    report = RetentionReport(graphs.ctx_entries() + kept, [d for d, s in zip(every, shown) if s])
    report.all_detached = every
    return report


_Found = tuple[str, torch.Tensor, Located]


def _reach(named: list[tuple[str, Any]], depth: int) -> tuple[list[_Found], set[int]]:
    """Phase 1: every tensor the roots hold, once per holder (a tensor in two lists is found
    in both), and the storages that live anyway (parameters, and what the roots hold
    outside a graph): charged to no graph."""
    visited: set[int] = set()
    anyway: set[int] = set()
    found: list[_Found] = []
    met: set[int] = set()  # tensors found once
    holders: set[tuple[int, int]] = set()  # (tensor, its direct holder) found
    for name, root in named:
        for tensor, located in walk(
            root, depth=depth, modules=True, visited=visited, classes=True, again=True
        ):
            pair = (id(tensor), id(located.holder()))
            if id(tensor) in met:
                # Met again: another holder, named too, unless the same one (``[t, t]``) or
                # a parameter (it lives anyway, whoever refers to it).
                if pair not in holders and _parameter_of(tensor) is None:
                    holders.add(pair)
                    found.append((name, tensor, located))
                continue
            met.add(id(tensor))
            holders.add(pair)
            found.append((name, tensor, located))
            param = _parameter_of(tensor)
            if param is not None:
                _adopt(param, anyway)
            elif tensor.grad_fn is None:
                key = _key(tensor)
                if key is not None:
                    anyway.add(key)
    return found, anyway


@dataclass
class _Judged:
    """One tensor's graph as phase 2 walked it, and its entry once made."""

    graph_bytes: int = 0
    nodes: int = 0
    backpropagated: bool = False
    retained: bool = False
    leaves: list[Any] = field(default_factory=list)
    entry: Retained | None = None


class _Graphs:
    """Phase 2: the graphs behind the tensors that have a ``grad_fn``. Bytes are counted
    once across all of them (``counted``), and ctx state once per node."""

    def __init__(self, anyway: set[int], made: Callable[[torch.Tensor], str]) -> None:
        self.anyway = anyway
        self.made = made
        self.counted: set[int] = set()
        self.budget = [_MAX_TOTAL_NODES]
        self.states: dict[int, tuple[bool, bool]] = {}  # node id -> (backward ran, kept)
        self.nodes_seen: set[int] = set()
        self.ctx_bytes: dict[str, int] = {}
        self.ctx_nodes: dict[str, int] = {}
        self.ctx_sites: dict[str, str] = {}
        self.judged: dict[int, _Judged] = {}  # tensor id -> its graph, walked once

    def judge(
        self, name: str, tensor: torch.Tensor, located: Located, everything: bool
    ) -> Retained | None:
        """The ``graph`` entry for ``tensor``, or None where a clean loop holds the same.
        A tensor found again from another holder gets the same entry under that holder's
        path (its graph walked and its bytes counted once)."""
        judged = self.judged.get(id(tensor))
        if judged is None:
            judged = self.judged[id(tensor)] = self._walk(tensor)
        listed = judged.backpropagated and (judged.retained or _in_growable(located))
        if not everything and not listed:
            return None
        if judged.entry is not None:
            return replace(judged.entry, where=located.named(name), listed=listed)
        ref = weakref.ref(tensor)
        leaf_bytes = sum(_leaf_bytes(node, self.counted, self.anyway) for node in judged.leaves)
        through = judged.graph_bytes + leaf_bytes
        pinned = f", {format_bytes(leaf_bytes)} of leaves and their .grad" if leaf_bytes else ""
        if judged.retained:
            how = "backpropagated with retain_graph=True, its saved tensors alive"
        elif judged.backpropagated:
            how = "already backpropagated"
        else:
            how = "never backpropagated, its saved tensors alive"
        judged.entry = Retained(
            "graph",
            located.named(name),
            through + tensor_bytes(tensor, self.counted, depth=0),
            f"a tensor whose graph was {how} ({judged.nodes} nodes{pinned}); detach it before "
            "keeping it",
            site=self.made(tensor),
            through_graph=through,
            floating=int(_computed(tensor)),
            nodes=judged.nodes,
            listed=listed,
            held=(ref,),
        )
        return judged.entry

    def _walk(self, tensor: torch.Tensor) -> _Judged:
        """Walk ``tensor``'s graph: whether it was backpropagated (or retained), the bytes
        its nodes keep, its leaves."""
        judged = _Judged()
        for node in _graph(tensor.grad_fn, self.budget):
            judged.nodes += 1
            state = self.states.get(id(node))
            if state is None:
                state = self.states[id(node)] = (backward_ran(node), _marked(node))
            ran, kept = state
            judged.backpropagated = judged.backpropagated or ran or kept
            judged.retained = judged.retained or kept
            if hasattr(node, "variable"):
                judged.leaves.append(node)
            if not ran:  # what it saved is alive: a retained graph's, or a branch never run
                judged.graph_bytes += tensor_bytes(
                    _saved(node), self.counted, depth=2, anyway=self.anyway
                )
            if isinstance(node, BackwardCFunction) and (ran or kept):
                judged.graph_bytes += self._ctx(node, ran)
        return judged

    def _ctx(self, node: Any, ran: bool) -> int:
        """Bytes of ``node``'s ctx state; tallied per attribute once per node that ran."""
        state_bytes = _ctx_state(node, self.counted, self.anyway)
        if ran and id(node) not in self.nodes_seen:
            self.nodes_seen.add(id(node))
            cls = node._forward_cls.__qualname__
            for attr, nbytes in state_bytes:
                where = f"{cls}.ctx.{attr}"
                self.ctx_bytes[where] = self.ctx_bytes.get(where, 0) + nbytes
                self.ctx_nodes[where] = self.ctx_nodes.get(where, 0) + 1
                self.ctx_sites.setdefault(where, _ctx_site(node, attr, self.made))
        return sum(n for _, n in state_bytes)

    def ctx_entries(self) -> list[Retained]:
        return [
            Retained(
                "ctx attribute",
                where,
                nbytes,
                f"{self.ctx_nodes[where]} node(s) kept it after their backward ran",
                site=self.ctx_sites.get(where, ""),
            )
            for where, nbytes in self.ctx_bytes.items()
        ]


_Holders = dict[tuple[int, str], tuple[str, Located, int, dict[int, torch.Tensor]]]


def _holders(found: list[_Found]) -> _Holders:
    """Phase 3's input: the growable containers that hold tensors without a graph (not
    parameters), each with its tensors, keyed by the container and the way from it to
    them with indices as ``[*]`` (``utterances[*].features`` apart from
    ``utterances[*].wave``: what grows apart from what does not)."""
    holders: _Holders = {}
    for name, tensor, located in found:
        if tensor.grad_fn is None and _parameter_of(tensor) is None:
            held = _holder(located)
            if held is not None:
                below = _below(located, held[2])
                entry = holders.setdefault((held[0], below), (name, held[1], held[2], {}))
                entry[3][id(tensor)] = tensor  # once, however many of its items hold it
    return holders


def _below(located: Located, up: int) -> str:
    """The way from the container ``up`` levels above a tensor down to it, indices as
    ``[*]`` (``[*].features``), where it names a field (an attribute, a key); "" for a
    tensor the container holds itself or through indices and closures only."""
    if not up:
        return ""
    path, container = located(), located.above(up)()
    below = path[len(container) :] if path.startswith(container) else path
    return _INDEX.sub("[*]", below) if _FIELD.search(below) else ""


def _ctx_site(node: Any, attr: str, made: Callable[[torch.Tensor], str]) -> str:
    for tensor, _ in walk(node.__dict__.get(attr), depth=3):
        site = made(tensor)
        if site:
            return site
    return ""


def _detached(
    holders: _Holders,
    since: RetentionReport | None,
    made: Callable[[torch.Tensor], str],
    everything: bool,
    site_of: SiteOf | None,
) -> tuple[list[Retained], list[bool]]:
    """Phase 3: every detached holder, and which to show: all with ``everything``, else
    those grown since ``since``."""
    shown: list[bool] = []
    before = {r.where: r for r in since.all_detached} if since is not None else {}
    out = []
    seen: set[int] = set()
    for (_, below), (name, located, up, held) in holders.items():
        tensors = list(held.values())
        nbytes = 0
        for t in tensors:
            key = _key(t)
            if key is not None and key not in seen:
                seen.add(key)
                nbytes += int(t.untyped_storage().nbytes())
        where = located.above(up).named(name) + below
        detail = f"{len(tensors)} tensor(s) without a graph"
        if since is not None:
            old = before.get(where)
            grew = len(tensors) - (old.count if old is not None else 0)
            more = nbytes - (old.nbytes if old is not None else 0)
            growing = grew > 0 or more > 0
            verdict = "growing" if growing else "not growing"
            detail += f"; {verdict}: {grew:+d} tensors, {_signed(more)} since the last report"
        else:
            growing = False
        site = next((m for m in map(made, reversed(tensors)) if m), "")
        floating = sum(1 for t in tensors if _computed(t))
        known = (site_of(t) for t in reversed(tensors)) if site_of is not None else iter(())
        note = _set_on_module(located, next((f for f in known if f is not None), None))
        out.append(
            Retained(
                "detached", where, nbytes, detail, len(tensors), site, floating=floating, note=note
            )
        )
        shown.append(everything or growing)
    return out, shown


def _set_on_module(located: Located, found: object) -> str:
    """What to say of a tensor set as a plain attribute on a module (not a parameter, a
    buffer or a submodule: those sit in the module's tables), ``found`` where it was made
    (a :class:`~leakfree.diagnostics.sites.Site`, or None): by which function, and, when
    its signature is a forward hook's (``module, args, output``), that removing the hook
    leaves the attribute. "" for a tensor held otherwise."""
    module = located.holder()
    if not isinstance(module, torch.nn.Module):
        return ""
    kind = type(module).__name__
    found = getattr(found, "caller", None) or found  # the user's own frame, if any
    code = getattr(found, "code", None)
    if code is None:
        return f"a plain attribute of each {kind} module (not a parameter or buffer)"
    args = code.co_varnames[: code.co_argcount]
    if args and args[0] == "self":
        args = args[1:]
    function = getattr(found, "function", code.co_name)
    if len(args) in (3, 4):  # (module, args, output), or (module, args, kwargs, output)
        return (
            f"set on each {kind} module by the forward hook {function}: removing the hook "
            "leaves the attribute, delete it then"
        )
    return f"set on each {kind} module by {function} (not a parameter or buffer)"


def _computed(tensor: torch.Tensor) -> bool:
    """A value a forward computes: floating point and more than one element (a scalar is a
    metric, an integer tensor ids or a mask)."""
    return (tensor.is_floating_point() or tensor.is_complex()) and tensor.numel() > 1


def _signed(nbytes: int) -> str:
    return ("-" if nbytes < 0 else "+") + format_bytes(abs(nbytes))
