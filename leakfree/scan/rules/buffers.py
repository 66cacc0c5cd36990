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
from collections.abc import Iterable, Iterator

from leakfree.scan._flow import Flow
from leakfree.scan._model import Finding, Project, Rule, Source
from leakfree.scan._syntax import functions, own_nodes, positional, tail

__all__ = ["RULES"]

CODE = "LF005"
CONFIRM = "leakfree.diagnostics.find_retained"

_FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef
_Loop = ast.For | ast.AsyncFor | ast.While

_FACTORIES = frozenset(
    {
        "empty",
        "zeros",
        "ones",
        "full",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "empty_strided",
        "new_empty",
        "new_zeros",
        "new_ones",
        "new_full",
    }
)
_RECV = frozenset({"recv", "irecv"})
#: calls with "recv" in their name that do not return a received tensor
_NOT_RECEIVED = frozenset({"recv", "irecv", "batch_isend_irecv", "isend_irecv", "recv_object_list"})
#: receive-named calls whose result is not a tensor
_NOT_TENSOR_SUFFIXES = ("ops", "_op", "info", "infos", "work", "works", "handle", "handles", "meta")
#: container methods that put the leaf in
_PUTS = frozenset({"append", "insert", "extend", "appendleft"})
#: methods whose result is the same data (an alias or a copy of the buffer)
_ALIASES = frozenset(
    {
        "detach",
        "view",
        "view_as",
        "reshape",
        "to",
        "contiguous",
        "clone",
        "float",
        "half",
        "bfloat16",
    }
)

MESSAGE = (
    "a received buffer is made an autograd leaf in a loop and its .grad read: each "
    "microbatch's gradient accumulates in .grad and pins a buffer until someone clears "
    "it; receive as a non-leaf with leakfree.pipeline.as_nonleaf(buf, slot) and take the "
    "gradient from slot.take()"
)


def _base_name(expr: ast.expr) -> str | None:
    """``buf.detach().view(...)`` -> ``buf``: the name an alias chain starts from."""
    while True:
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
            if expr.func.attr not in _ALIASES and expr.func.attr != "requires_grad_":
                return None
            expr = expr.func.value
        elif isinstance(expr, ast.Name):
            return expr.id
        else:
            return None


def _true(expr: ast.expr | None) -> bool:
    return expr is None or not (isinstance(expr, ast.Constant) and expr.value in (False, 0))


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


def _received_in(loop: _Loop, helpers: _Helpers) -> tuple[set[str], dict[str, ast.AST]]:
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
        if fname in _FACTORIES and name in recv_args:
            received.add(name)
            for kw in value.keywords:
                if kw.arg == "requires_grad" and _true(kw.value):
                    born_leaf[name] = value
        elif _receives(fname):
            received.add(name)
            if helpers.receive_makes_leaf(fname):
                born_leaf[name] = value
        elif _base_name(value) in received:
            received.add(name)
    return received, born_leaf


def _creates_leaf(call: ast.Call) -> bool:
    """``torch.empty(..., requires_grad=True)`` (any factory, a non-False value) or
    ``t.requires_grad_()``."""
    name = tail(call.func)
    requires = _kw(call, "requires_grad")
    if name in _FACTORIES:
        return requires is not None and _true(requires)
    return name == "requires_grad_" and _true(call.args[0] if call.args else requires)


def _made_leaf(node: ast.AST, names: set[str]) -> str | None:
    """The name ``node`` makes an autograd leaf (``n.requires_grad_()``, ``n.detach()
    .requires_grad_()``, ``n.requires_grad = True``) if it is one of ``names``."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "requires_grad_"
        and _true(node.args[0] if node.args else _kw(node, "requires_grad"))
    ):
        base = _base_name(node.func.value)
        return base if base in names else None
    if isinstance(node, ast.Assign) and (
        isinstance(node.value, ast.Constant) and node.value.value is True
    ):
        for t in node.targets:
            if (
                isinstance(t, ast.Attribute)
                and t.attr == "requires_grad"
                and isinstance(t.value, ast.Name)
                and t.value.id in names
            ):
                return t.value.id
    return None


def _leaf_sites(
    loop: _Loop, received: set[str], helpers: _Helpers
) -> list[tuple[ast.AST, str, set[str]]]:
    """(node, buffer name, its leaf aliases) where a received buffer is made a leaf: in the
    loop itself, or by a helper the loop passes it to (``forward_step(..., x)`` whose body
    sets ``x.requires_grad = True``)."""
    nodes = list(own_nodes(loop))
    sites: list[tuple[ast.AST, str, set[str]]] = []
    made: dict[int, set[str]] = {}
    for node in nodes:
        base = _made_leaf(node, received)
        if base is not None:
            made[id(node)] = {base}
            sites.append((node, base, made[id(node)]))
        elif isinstance(node, ast.Call):
            method = isinstance(node.func, ast.Attribute)
            for i, arg in enumerate(node.args):
                base = _base_name(arg)
                if base in received and helpers.makes_leaf(tail(node.func), i, method):
                    sites.append((node, base, {base}))
                    break
    # ``x = buf.requires_grad_()``: x is the leaf too
    for name, value, _node in Flow(loop).assigned():
        for sub in ast.walk(value):
            if id(sub) in made:
                made[id(sub)].add(name)
    return sites


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


class _Helpers:
    """What the scanned tree's functions do with a received tensor: whether a leaf's
    ``.grad`` is read (in its function, its class or a helper it is passed to), and
    whether a helper makes its parameter a leaf."""

    def __init__(self, source: Source, project: Project) -> None:
        self.source = source
        self.project = project
        self._helper_cache: dict[tuple[str, int, bool], bool] = {}
        self._leaf_cache: dict[tuple[str, int, bool], bool] = {}
        self._receive_cache: dict[str, bool] = {}

    def _param_names(
        self, name: str, index: int, attribute_call: bool
    ) -> Iterator[tuple[list[ast.AST], set[str]]]:
        """For each function ``name`` in the tree: its own nodes, and the names its
        parameter at call position ``index`` reaches (itself, loop variables over it)."""
        for _src, fn in self.project.helpers(name):
            params = positional(fn)
            if params and params[0] in ("self", "cls"):
                if not attribute_call:  # a bare call never reaches a method
                    continue
                params = params[1:]
            if index >= len(params):
                continue
            nodes = list(own_nodes(fn))
            names = {params[index]}
            self._spread(nodes, names, set())
            yield nodes, names

    def receive_makes_leaf(self, name: str) -> bool:
        """Whether a receive function ``name``, or a function it calls that is defined in
        its own file, creates a tensor with ``requires_grad=True`` or calls
        ``requires_grad_()`` (nested functions included)."""
        found = self._receive_cache.get(name)
        if found is None:
            found = False
            for src, fn in self.project.helpers(name):
                callees = set()
                for n in ast.walk(fn):
                    if isinstance(n, ast.Call):
                        if _creates_leaf(n):
                            found = True
                            break
                        callees.add(tail(n.func))
                if found:
                    break
                # one call deeper, only into the same file (a common name such as
                # ``get`` would otherwise match unrelated functions across the tree)
                local = self.project.defs(src)
                found = any(
                    _creates_leaf(n)
                    for c in callees
                    for callee in local.get(c, ())
                    if callee is not fn
                    for n in ast.walk(callee)
                    if isinstance(n, ast.Call)
                )
                if found:
                    break
            self._receive_cache[name] = found
        return found

    def makes_leaf(self, name: str, index: int, attribute_call: bool) -> bool:
        """Whether a function ``name`` makes its argument at ``index`` an autograd leaf."""
        key = (name, index, attribute_call)
        found = self._leaf_cache.get(key)
        if found is None:
            found = any(
                _made_leaf(n, names) is not None
                for nodes, names in self._param_names(name, index, attribute_call)
                for n in nodes
            )
            self._leaf_cache[key] = found
        return found

    def read(self, fn: _FunctionNode, cls: ast.ClassDef | None, aliases: set[str]) -> bool:
        names = set(aliases)
        containers: set[str] = set()
        nodes = list(own_nodes(fn))
        self._spread(nodes, names, containers)
        if self._reads(nodes, names, containers):
            return True
        shared = {c for c in containers if c.startswith("self.")}
        if cls is not None and shared:
            for method in cls.body:
                if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) and method is not fn:
                    m_nodes = list(own_nodes(method))
                    m_names: set[str] = set()
                    m_containers = set(shared)
                    self._spread(m_nodes, m_names, m_containers)
                    if self._reads(m_nodes, m_names, m_containers):
                        return True
        return False

    @staticmethod
    def _spread(nodes: list[ast.AST], names: set[str], containers: set[str]) -> None:
        """Follow the leaf into containers and back out, to a fixed point (two passes)."""
        for _ in range(2):
            for node in nodes:
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    if node.func.attr in _PUTS and any(_mentions(a, names) for a in node.args):
                        containers.add(ast.unparse(node.func.value))
                elif isinstance(node, ast.Assign):
                    for t in node.targets:
                        if isinstance(t, ast.Subscript) and _mentions(node.value, names):
                            containers.add(ast.unparse(t.value))
                        elif isinstance(t, (ast.Name, ast.Tuple)) and _drawn(
                            node.value, containers
                        ):
                            names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
                        elif isinstance(t, ast.Name) and _base_name(node.value) in names:
                            names.add(t.id)
                elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)) and (
                    _drawn(node.iter, containers) or _mentions(node.iter, names)
                ):
                    names.update(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name))

    def _reads(self, nodes: list[ast.AST], names: set[str], containers: set[str]) -> bool:
        for node in nodes:
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "grad"
                and isinstance(node.ctx, ast.Load)
            ):
                v = node.value
                if isinstance(v, ast.Name) and v.id in names:
                    return True
                if _drawn(v, containers):
                    return True
            if isinstance(node, ast.Call):
                method = isinstance(node.func, ast.Attribute)
                callees = _callees(node.func, nodes)
                for i, arg in enumerate(node.args):
                    if (_mentions(arg, names) or _drawn(arg, containers)) and any(
                        self._helper_reads(name, i + bound, method) for name, bound in callees
                    ):
                        return True
        return False

    def _helper_reads(self, name: str, index: int, attribute_call: bool) -> bool:
        """Whether a function ``name`` reads ``.grad`` of its argument at ``index``."""
        key = (name, index, attribute_call)
        found = self._helper_cache.get(key)
        if found is None:
            found = any(
                isinstance(n, ast.Attribute)
                and n.attr == "grad"
                and isinstance(n.ctx, ast.Load)
                and isinstance(n.value, ast.Name)
                and n.value.id in names
                for nodes, names in self._param_names(name, index, attribute_call)
                for n in nodes
            )
            self._helper_cache[key] = found
        return found


def _callees(func: ast.expr, nodes: list[ast.AST]) -> list[tuple[str, int]]:
    """The function names a call may reach, each with how many leading positional
    parameters are already bound: its own name, and for a local variable the functions
    assigned to it (``backward_func = backward_step`` or ``partial(backward_step, ...)``,
    as Megatron-LM's schedules do)."""
    name = tail(func)
    out = [(name, 0)]
    if not isinstance(func, ast.Name):
        return out
    for node in nodes:
        if not (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == name
        ):
            continue
        value = node.value
        if isinstance(value, ast.Name):
            out.append((value.id, 0))
        elif isinstance(value, ast.Call) and tail(value.func) == "partial" and value.args:
            out.append((tail(value.args[0]), len(value.args) - 1))
    return out


def _mentions(expr: ast.AST, names: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(expr))


def _drawn(expr: ast.AST, containers: set[str]) -> bool:
    """``c.pop(...)``, ``c.popleft()``, ``c[i]`` or ``c`` itself for a container ``c``."""
    if not containers:
        return False
    if isinstance(expr, (ast.Name, ast.Attribute)):  # iterated or passed on whole
        return ast.unparse(expr) in containers
    if isinstance(expr, ast.Subscript):
        return ast.unparse(expr.value) in containers
    if (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Attribute)
        and expr.func.attr in ("pop", "popleft", "get")
    ):
        return ast.unparse(expr.func.value) in containers
    return False


def check(source: Source, project: Project) -> Iterable[Finding]:
    # a receive happens in this file (the leaf may be made by a helper elsewhere): a
    # cheap prefilter on the text
    text = source.text
    if "recv" not in text and "receive" not in text:
        return []
    reads = _Helpers(source, project)
    found: dict[tuple[int, int], Finding] = {}
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


RULES: tuple[Rule, ...] = (
    Rule(
        code=CODE,
        name="leaf-receive-buffer",
        summary=(
            "a received buffer is made a requires-grad leaf inside a loop and its .grad "
            "read: one pinned buffer and gradient per microbatch"
        ),
        confirm=CONFIRM,
        check=check,
        needs=("requires_grad",),
    ),
)
