"""LF003: a value that can carry an autograd graph is kept in a container that outlives the step.

The loss-logging shape. A training loop keeps losses "for logging" in a list or dict that
lives longer than one step (an attribute of ``self``, a module global, the ``losses`` dict
of a per-step context object) and appends the loss itself, not ``loss.detach()``. Each entry
keeps its whole graph alive, and with it everything the graph's custom Functions left on
``ctx``, until the container is cleared: in Fast-LLM (``losses[name].append(total_loss)``,
the dict being ``context.losses``) about 164 MiB per microbatch and an OOM at 128
microbatches. A running sum kept on ``self`` (``self.total_loss += loss``) is worse: it
chains every step's graph into one that never dies.

How the rule decides, function by function (and over the module's own statements, where
every name is a global), statements in source order (precision first):

*Can carry a graph.* An expression is a **loss** when it is a name spelled like one
(``loss``, ``losses``, ``*_loss``, ``*_losses``), an attribute or string key named so
(``outputs.loss``, ``out["loss"]``), the result of a call to something named like a loss
function (``criterion``, ``loss_fn``, ``loss_func``, ``compute_loss``, ``*_loss``,
``F.cross_entropy`` and the other ``torch.nn.functional`` losses), or arithmetic, a
graph-preserving method (``.mean()``, ``.sum()``, ``.float()``, ``.to()``, ``.cpu()``...) or
a ``torch.*`` function (``torch.stack``) applied to a loss. It is a **forward result** when
it is named ``logits``/``output(s)``, or comes from calling a model or module (``model(x)``,
``self.model(x)``, ``self(x)``, ``.forward(...)``). The latest local assignment decides
over the spelling: ``loss = loss.detach()`` or ``output = {"step": ...}`` make the name
clean; a value fetched into a name spelled like a loss (``aux_loss = model.aux(x)``,
``loss = outputs[0]``) is a loss, unless it is a dict lookup (``kwargs.get(...)``) or
arithmetic on unknowns (``smoothed_loss = self.avg / c``). Clean: literals, f-strings,
comparisons, ``float()``/``int()``/``len()``, ``.detach()``, ``.item()``, ``.tolist()``,
``.numpy()``, ``.data``, metadata (``.shape``, ``.dtype``, ``.size()``...),
``detach_tree(...)``. Anything else is unknown, and unknown is never flagged: a method off
the graph-keeping list, a call of anything else, ``self.loss`` (as often a loss module or a
list of floats as a tensor).

*Outlives the step.* The receiver (``R`` in ``R.append(v)``, ``R.extend(v)``,
``R.insert(i, v)``, ``R.add(v)``, ``R.update({k: v})`` / ``R.update(k=v)``, ``R[k] = v``,
``R[k].append(v)``, ``R.setdefault(k, []).append(v)``, ``R += v``) is rooted at
``self``/``cls`` (``self.history``), at a module global, at a local alias of one of those
(``hist = self.history``), at a local list later stored into one, or at a parameter whose
name or attribute path reads like a log or a per-step context (``losses[name]``,
``context.losses[name]``, ``state.log_history``). A local list that dies with the function,
or is returned, is quiet (returning losses to a caller that calls ``backward`` on them is
the normal path); so is a metric object's ``update(loss)`` (torchmetrics updates run without
grad).

*Quiet on purpose.* A forward result (not a loss) is flagged only into a container named
like a log (``losses``, ``metrics``, ``history``, ``stats``, ``logs``...): pipeline
schedules and caches keep outputs on ``self`` for a later backward. A ``self`` container
that a method of the class reads into a backward call (``loss = self._pending[i]`` then
``loss.backward()``, ``stage_backward(self.fwd_cache[i])``) feeds backward and is quiet.
Code under ``torch.no_grad()`` / ``torch.inference_mode()`` (block or decorator) and in
``validation_step`` / ``test_step`` / ``predict_step`` / ``prediction_step`` / ``evaluate*``
/ ``eval_*`` is quiet (no graph is built there), even for a loss computed outside the block
(a miss traded for silence on evaluation loops); a container built as ``LossLog(...)``
(found by the attribute or keyword name it is bound to, anywhere in the file) detaches by
itself and is quiet; so is anything inside a ``torch.autograd.Function`` (LF001 covers
``ctx``). A plain attribute assignment (``self.last_loss = loss``) keeps one step's graph
until the next step and is not flagged; a running sum (``self.total += loss``, ``self.total
= self.total + loss``) is.

*Helpers.* A call whose argument is a loss, to a helper defined in the scanned tree that
appends that parameter unchanged to a long-lived container (Fast-LLM's
``self._register_loss(name, loss, losses)`` -> ``losses[name].append(value)``), is flagged
at the call. Names are not resolved through imports: a definition in the same file wins,
and when several are found every one must store the parameter.

*Speed.* A function whose text has no loss-like word, or no forward-like word and no
store, cannot be flagged and is skipped before any walk; a helper is looked at only when a
call passes a loss.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

from leakfree.scan._model import Finding, FunctionNode, Project, Rule, Source

__all__ = ["RULES"]

_T = TypeVar("_T")

CODE = "LF003"
CONFIRM = "leakfree.diagnostics.find_retained"


class Kind(Enum):
    LOSS = "loss"
    FORWARD = "forward result"
    CLEAN = "clean"


#: ``loss``, ``losses``, ``total_loss``, ``aux_losses``
_LOSS_NAME = re.compile(r"^(?:\w+_)?loss(?:es)?$", re.IGNORECASE)
_FORWARD_NAME = re.compile(r"^(?:\w+_)?(?:logits|outputs?)$", re.IGNORECASE)
#: callees that return a loss
_LOSS_CALLEE = re.compile(
    r"^(?:\w+_)?(?:criterion|loss_fn|loss_func|lossfn|loss_function|loss)$"
    r"|^(?:compute|calc|calculate|get)_\w*loss(?:es)?$",
    re.IGNORECASE,
)
#: ``torch.nn.functional`` losses (those ending in ``_loss`` match by name too)
_TORCH_LOSSES = frozenset(
    {
        "cross_entropy",
        "binary_cross_entropy",
        "binary_cross_entropy_with_logits",
        "kl_div",
        "ctc_loss",
        "nll_loss",
        "mse_loss",
        "l1_loss",
    }
)
#: callees that run a model forward
_MODEL_CALLEE = re.compile(r"^(?:\w+_)?(?:model|module|net|network|forward)$", re.IGNORECASE)
#: methods that keep the graph of their receiver
_KEEP = frozenset(
    {
        "mean", "sum", "float", "double", "half", "bfloat16", "to", "cpu", "cuda", "view",
        "view_as", "reshape", "clone", "squeeze", "unsqueeze", "contiguous", "flatten",
        "expand", "expand_as", "mul", "add", "sub", "div", "pow", "sqrt", "abs", "exp", "log",
        "neg", "clamp", "nan_to_num", "masked_fill", "norm", "type_as", "nanmean", "nansum",
        "prod", "max", "min", "sigmoid", "softmax", "log_softmax", "squeeze_", "t",
    }
)  # fmt: skip
#: methods and attributes whose result has no graph
_DETACH = frozenset({"detach", "item", "tolist", "numpy", "data", "detach_tree"})
_METADATA = frozenset(
    {
        "shape", "dtype", "device", "ndim", "requires_grad", "is_leaf", "grad_fn", "grad",
        "layout", "names", "is_cuda", "size", "dim", "numel", "nelement", "element_size",
        "get_device", "is_contiguous", "data_ptr", "stride", "storage_offset", "is_floating_point",
        "isnan", "isinf", "isfinite", "eq", "ne", "gt", "lt", "ge", "le", "argmax", "argmin",
        "long", "int", "bool", "any", "all", "keys",
    }
)  # fmt: skip
_CLEAN_BUILTINS = frozenset(
    {"float", "int", "bool", "len", "str", "repr", "round", "format", "isinstance", "id", "hash"}
)
_JOIN_BUILTINS = frozenset({"sum", "max", "min", "abs", "list", "tuple"})
_TORCH_MODULES = frozenset({"torch", "F", "functional", "nn"})
#: torch.* functions that never return a graph
_TORCH_CLEAN = frozenset(
    {"is_tensor", "is_floating_point", "numel", "typename", "isnan", "isinf", "isfinite",
     "equal", "allclose", "argmax", "argmin", "no_grad", "zeros_like", "ones_like", "empty_like",
     "tensor", "as_tensor", "full_like"}
)  # fmt: skip
#: words of a container name that read like a log kept across steps
_LOG_WORDS = frozenset(
    {
        "loss", "losses", "metric", "metrics", "log", "logs", "logged", "history", "histories",
        "stats", "statistics", "record", "records", "tracker", "summary", "summaries",
        "scalars", "running",
    }
)  # fmt: skip
#: parameter names of per-step context / state objects
_CONTEXT_PARAMS = frozenset(
    {"context", "batch_context", "step_context", "run_context", "state", "train_state"}
)
_SINK_METHODS = frozenset({"append", "extend", "insert", "add", "appendleft"})
_NO_GRAD_STEPS = re.compile(
    r"^(?:validation_step|test_step|predict_step|prediction_step|evaluate\w*|eval_\w*|"
    r"_?eval_step|\w*_eval)$"
)
_NO_GRAD_CTX = frozenset({"no_grad", "inference_mode"})
_BACKWARD_CALLS = frozenset(
    {"backward", "grad", "stage_backward", "manual_backward", "run_backward"}
)
_LOSSLOG_TYPES = frozenset({"LossLog", "LossList", "RunningLoss"})
#: calls never followed as storing helpers
_NOT_HELPERS = _SINK_METHODS | {"update", "backward", "forward", "print", "super"}


def _tail(node: ast.expr) -> str:
    """The last name of ``a.b.c`` / ``c``; empty for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _is_lookup(value: ast.expr) -> bool:
    """``kwargs.get("partial_losses")``: a dict lookup says nothing about what it holds."""
    return isinstance(value, ast.Call) and _tail(value.func) in {"get", "pop", "setdefault"}


def _join(kinds: Iterable[Kind | None]) -> Kind | None:
    seen = list(kinds)
    if Kind.LOSS in seen:
        return Kind.LOSS
    if Kind.FORWARD in seen:
        return Kind.FORWARD
    if seen and all(k is Kind.CLEAN for k in seen):
        return Kind.CLEAN
    return None


def _name_kind(name: str) -> Kind | None:
    name = name.rstrip("_")
    if name.isupper():
        return None  # a constant or an enum member (Kind.LOSS), never a tensor
    if _LOSS_NAME.match(name):
        return Kind.LOSS
    if _FORWARD_NAME.match(name):
        return Kind.FORWARD
    return None


def _is_no_grad_with(item: ast.withitem) -> bool:
    expr = item.context_expr
    if isinstance(expr, ast.Call):
        expr = expr.func
    return _tail(expr) in _NO_GRAD_CTX


def _is_no_grad_decorated(func: FunctionNode) -> bool:
    for dec in func.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if _tail(target) in _NO_GRAD_CTX:
            return True
    return False


def _root(node: ast.expr) -> tuple[ast.Name | None, list[str]]:
    """The name ``R`` is rooted at and the attribute/call names on the way (outer last)."""
    path: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            path.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in {"setdefault", "get", "__getitem__"}
        ):
            node = node.func.value
        else:
            break
    path.reverse()
    return (node if isinstance(node, ast.Name) else None), path


def _symbol(node: ast.expr) -> str:
    """``context.losses[name]`` -> ``context.losses``: the container, without keys."""
    root, path = _root(node)
    if root is None:
        return ast.unparse(node)
    return ".".join([root.id, *path])


def _words(name: str) -> set[str]:
    return {w for w in name.lower().strip("_").split("_") if w}


def _log_like(names: Iterable[str]) -> bool:
    return any(_words(n) & _LOG_WORDS for n in names)


@dataclass
class _Env:
    """What one function knows: kinds and container roots of its local names."""

    kinds: dict[str, Kind | None] = field(default_factory=dict)
    #: local name -> the long-lived expression it aliases (``hist = self.history``)
    aliases: dict[str, ast.expr] = field(default_factory=dict)
    #: locals created as fresh containers (``[]``, ``{}``, ``defaultdict(list)``)
    fresh: set[str] = field(default_factory=set)


@dataclass
class _Module:
    """Per-file facts the rule needs: globals, LossLog-typed names, backward-fed attributes."""

    globals: set[str]
    losslog_names: set[str]
    backward_attrs: dict[int, set[str]]  # id(class node) -> self attributes read near backward


def _module_facts(tree: ast.Module, text: str) -> _Module:
    globals_: set[str] = set()
    for stmt in tree.body:
        targets: list[ast.expr] = []
        if isinstance(stmt, ast.Assign):
            targets = stmt.targets
        elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
            targets = [stmt.target]
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    globals_.add(n.id)
    losslog: set[str] = set()
    if any(name in text for name in _LOSSLOG_TYPES):
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _tail(node.func) in _LOSSLOG_TYPES:
                losslog |= _assigned_names_of_call(tree, node)
    return _Module(globals_, losslog, {})


def _class_backward_attrs(module: _Module, cls: ast.ClassDef) -> set[str]:
    """Computed on demand: only a would-be finding on ``self`` asks."""
    attrs = module.backward_attrs.get(id(cls))
    if attrs is None:
        attrs = set()
        for fn in ast.walk(cls):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                attrs |= _backward_attrs(fn)
        module.backward_attrs[id(cls)] = attrs
    return attrs


def _assigned_names_of_call(tree: ast.Module, call: ast.Call) -> set[str]:
    """Names and attribute names a ``LossLog(...)`` call is bound to (computed lazily)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is call:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {_tail(t) for t in targets if _tail(t)}
        elif isinstance(node, ast.keyword) and node.value is call and node.arg:
            out.add(node.arg)
    return out


def _self_attrs_and_names(nodes: Iterable[ast.AST]) -> tuple[set[str], set[str]]:
    attrs: set[str] = set()
    names: set[str] = set()
    for root in nodes:
        for n in ast.walk(root):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
                if n.value.id == "self":
                    attrs.add(n.attr)
            elif isinstance(n, ast.Name) and n.id != "self":
                names.add(n.id)
    return attrs, names


def _backward_attrs(fn: FunctionNode) -> set[str]:
    """``self`` attributes whose values reach a backward call in ``fn``:
    ``self.fwd_cache[i]`` in ``stage_backward(...)``, or ``loss = self._losses[i]``
    followed by ``loss.backward()`` (local names are followed through assignments)."""
    roots: list[ast.AST] = []
    for n in ast.walk(fn):
        if not isinstance(n, ast.Call) or _tail(n.func) not in _BACKWARD_CALLS:
            continue
        if isinstance(n.func, ast.Attribute) and _tail(n.func) == "backward":
            roots.append(n.func.value)  # x.backward(): x, not self.accelerator
        if _tail(n.func) == "grad" and not (
            isinstance(n.func, ast.Attribute) and _tail(n.func.value) == "autograd"
        ):
            continue
        roots.extend([*n.args, *(k.value for k in n.keywords)])
    if not roots:
        return set()
    attrs, names = _self_attrs_and_names(roots)
    assigns: dict[str, list[ast.expr]] = {}
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                for leaf in ast.walk(t):
                    if isinstance(leaf, ast.Name):
                        assigns.setdefault(leaf.id, []).append(n.value)
        elif isinstance(n, ast.For):
            for leaf in ast.walk(n.target):
                if isinstance(leaf, ast.Name):
                    assigns.setdefault(leaf.id, []).append(n.iter)
    seen: set[str] = set()
    todo = list(names)
    while todo:
        local = todo.pop()
        if local in seen:
            continue
        seen.add(local)
        more_attrs, more_names = _self_attrs_and_names(assigns.get(local, ()))
        attrs |= more_attrs
        todo.extend(more_names - seen)
    return attrs


class _FunctionScan:
    """One function's statements in source order, tracking local kinds and aliases."""

    def __init__(
        self,
        source: Source,
        project: Project,
        module: _Module,
        func: FunctionNode,
        cls: ast.ClassDef | None,
    ) -> None:
        self.source = source
        self.project = project
        self.module = module
        self.func = func
        self.cls = cls
        args = func.args
        self.params = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
        if args.vararg:
            self.params.append(args.vararg.arg)
        if args.kwarg:
            self.params.append(args.kwarg.arg)
        self.self_name = self.params[0] if cls is not None and self.params else None
        #: the module's own statements (a training script's loop): every name is a global
        self.module_scope = func.name == _MODULE_SCOPE
        self.env = _Env()
        self.findings: list[Finding] = []
        #: local fresh containers that received a graph value: name -> (node, kind, value text)
        self.pending: dict[str, list[tuple[ast.AST, str]]] = {}

    @functools.cached_property
    def _scope(self) -> tuple[set[str], set[str]]:
        """(names declared ``global``, names bound locally); only a would-be finding asks."""
        declared: set[str] = set()
        bound: set[str] = set()
        for n in ast.walk(self.func):
            if isinstance(n, ast.Global):
                declared.update(n.names)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                bound.add(n.id)
        return declared, bound

    @property
    def declared_global(self) -> set[str]:
        return self._scope[0]

    @property
    def locals(self) -> set[str]:
        return self._scope[1]

    # -- kinds ---------------------------------------------------------------------------
    def kind(self, e: ast.expr) -> Kind | None:
        if isinstance(e, ast.Name):
            if e.id in self.env.kinds:
                return self.env.kinds[e.id]
            if e.id == self.self_name:
                return None
            return _name_kind(e.id)
        if isinstance(e, ast.Constant | ast.JoinedStr | ast.Compare | ast.Lambda):
            return Kind.CLEAN
        if isinstance(e, ast.Attribute):
            if e.attr in _DETACH or e.attr in _METADATA:
                return Kind.CLEAN
            if isinstance(e.value, ast.Name) and e.value.id == self.self_name:
                # self.loss / self.losses is as often a loss module or a container of
                # floats as a tensor: the attribute's name alone decides nothing
                return None
            base = self.kind(e.value)
            if base is Kind.CLEAN:
                return Kind.CLEAN
            if _LOSS_NAME.match(e.attr) and not e.attr.isupper():
                return Kind.LOSS
            if base is not None:
                return base
            return Kind.FORWARD if _FORWARD_NAME.match(e.attr) and e.attr != "output" else None
        if isinstance(e, ast.Subscript):
            base = self.kind(e.value)
            if base is not None:
                return base
            key = e.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                return Kind.LOSS if _LOSS_NAME.match(key.value) else None
            return None
        if isinstance(e, ast.BinOp):
            return _join([self.kind(e.left), self.kind(e.right)])
        if isinstance(e, ast.UnaryOp):
            return Kind.CLEAN if isinstance(e.op, ast.Not) else self.kind(e.operand)
        if isinstance(e, ast.BoolOp):
            return Kind.CLEAN
        if isinstance(e, ast.IfExp):
            return _join([self.kind(e.body), self.kind(e.orelse)])
        if isinstance(e, ast.List | ast.Tuple | ast.Set):
            # an empty container is unknown: what is appended to it later decides
            return _join(self.kind(x) for x in e.elts) if e.elts else None
        if isinstance(e, ast.Dict):
            return _join(self.kind(v) for v in e.values if v is not None) if e.values else None
        if isinstance(e, ast.Await):
            return self.kind(e.value)
        if isinstance(e, ast.Call):
            return self.call_kind(e)
        return None

    def call_kind(self, e: ast.Call) -> Kind | None:
        func = e.func
        name = _tail(func)
        if name in _DETACH or name in _METADATA:
            return Kind.CLEAN
        if isinstance(func, ast.Name):
            if name in _CLEAN_BUILTINS:
                return Kind.CLEAN
            if name in _JOIN_BUILTINS:
                return _join(self.kind(a) for a in e.args) if e.args else None
            if name == self.self_name and name != "cls":
                return Kind.FORWARD  # self(x): a module calling its own forward
        if isinstance(func, ast.Attribute):
            base = func.value
            if (isinstance(base, ast.Name) and base.id in _TORCH_MODULES) or (
                isinstance(base, ast.Attribute) and base.attr in {"functional", "nn"}
            ):
                if name in _TORCH_LOSSES or _LOSS_NAME.match(name):
                    return Kind.LOSS
                if name in _TORCH_CLEAN:
                    return Kind.CLEAN
                return _join(self.kind(a) for a in e.args) if e.args else None
            receiver = self.kind(base)
            if receiver is Kind.CLEAN:
                return Kind.CLEAN
            if receiver is not None and name in _KEEP:
                return receiver
        if _LOSS_CALLEE.match(name) or (_LOSS_NAME.match(name) and name != "losses"):
            return Kind.LOSS
        if _MODEL_CALLEE.match(name):
            return Kind.FORWARD
        return None

    # -- containers ------------------------------------------------------------------
    def long_lived(self, recv: ast.expr) -> tuple[bool, list[str]]:
        """Whether ``recv`` outlives this call, and the names on its path (for log-likeness)."""
        root, path = _root(recv)
        if root is None:
            return False, path
        rid = root.id
        if self.module_scope:
            return rid in self.module.globals, [rid, *path]
        if rid in self.env.aliases:
            alias = self.env.aliases[rid]
            ok, apath = self.long_lived(alias)
            return ok, [*apath, rid, *path]
        if rid == self.self_name or rid == "cls":
            return bool(path), path
        if rid in self.module.globals and (
            rid in self.declared_global or (rid not in self.locals and rid not in self.params)
        ):
            return True, [rid, *path]
        if rid in self.params and rid != self.self_name:
            names = [rid, *path]
            if rid in _CONTEXT_PARAMS or _log_like(names):
                return True, names
        return False, [rid, *path]

    def is_losslog(self, recv: ast.expr) -> bool:
        root, path = _root(recv)
        names = ([root.id] if root else []) + path
        return any(n in self.module.losslog_names for n in names)

    def feeds_backward(self, recv: ast.expr) -> bool:
        root, path = _root(recv)
        if self.cls is None or root is None or root.id != self.self_name or not path:
            return False
        return path[0] in _class_backward_attrs(self.module, self.cls)

    # -- statements ------------------------------------------------------------------
    def run(self) -> list[Finding]:
        if _is_no_grad_decorated(self.func) or _NO_GRAD_STEPS.match(self.func.name):
            return []
        self.block(self.func.body)
        return self.findings

    def block(self, body: list[ast.stmt]) -> None:
        for stmt in body:
            self.stmt(stmt)

    def stmt(self, s: ast.stmt) -> None:
        if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            return  # nested scopes are scanned on their own
        if isinstance(s, ast.With | ast.AsyncWith):
            if any(_is_no_grad_with(i) for i in s.items):
                self.forget_assigned(s.body)
                return
            self.block(s.body)
            return
        if isinstance(s, ast.Assign):
            self.check_calls(s.value)
            for t in s.targets:
                self.assign(t, s.value, s)
            return
        if isinstance(s, ast.AnnAssign):
            if s.value is not None:
                self.check_calls(s.value)
                self.assign(s.target, s.value, s)
            return
        if isinstance(s, ast.AugAssign):
            self.augassign(s)
            return
        if isinstance(s, ast.Expr):
            self.check_calls(s.value)
            return
        if isinstance(s, ast.For | ast.AsyncFor):
            for n in ast.walk(s.target):
                if isinstance(n, ast.Name):
                    self.env.kinds[n.id] = None
            self.block(s.body)
            self.block(s.orelse)
            return
        if isinstance(s, ast.While | ast.If):
            self.block(s.body)
            self.block(s.orelse)
            return
        if isinstance(s, ast.Try):
            self.block(s.body)
            for h in s.handlers:
                self.block(h.body)
            self.block(s.orelse)
            self.block(s.finalbody)
            return
        if isinstance(s, ast.Match):
            for case in s.cases:
                self.block(case.body)
            return
        if isinstance(s, ast.Return) and s.value is not None:
            self.check_calls(s.value)

    def forget_assigned(self, body: list[ast.stmt]) -> None:
        """Names assigned under no_grad carry no graph."""
        for stmt in body:
            for n in ast.walk(stmt):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    self.env.kinds[n.id] = Kind.CLEAN

    def assign(self, target: ast.expr, value: ast.expr, stmt: ast.stmt) -> None:
        if isinstance(target, ast.Name):
            kind = self.kind(value)
            if _name_kind(target.id) is Kind.LOSS and (
                kind is Kind.FORWARD
                or (
                    kind is None
                    and isinstance(value, ast.Call | ast.Subscript | ast.Attribute)
                    and not _is_lookup(value)
                )
            ):
                # loss = outputs[0], aux_loss = model.aux(x): a value fetched and named a
                # loss is one (arithmetic on unknowns, smoothed_loss = avg / c, is not)
                kind = Kind.LOSS
            self.env.kinds[target.id] = kind
            self.env.aliases.pop(target.id, None)
            self.env.fresh.discard(target.id)
            if self.module_scope:
                pass  # a module-level list is a global: it lives as long as the module
            elif self.is_fresh_container(value):
                self.env.fresh.add(target.id)
            elif isinstance(value, ast.Attribute | ast.Subscript | ast.Name):
                ok, _ = self.long_lived(value)
                if ok:
                    self.env.aliases[target.id] = value
            return
        if isinstance(target, ast.Tuple | ast.List):
            for t in target.elts:
                if isinstance(t, ast.Name):
                    # ``loss, grad = f(...)``: the element named like a loss is one
                    self.env.kinds[t.id] = (
                        _join([_name_kind(t.id)])
                        if self.kind(value) is not Kind.CLEAN
                        else Kind.CLEAN
                    )
                    self.env.aliases.pop(t.id, None)
                    self.env.fresh.discard(t.id)
            return
        if isinstance(target, ast.Subscript):
            self.sink(target.value, value, stmt)
            return
        if (
            isinstance(target, ast.Attribute)
            and isinstance(value, ast.BinOp)
            and isinstance(value.op, ast.Add | ast.Sub)
            and ast.unparse(target) in {ast.unparse(value.left), ast.unparse(value.right)}
        ):
            # self.total = self.total + loss: a running sum spelled out
            other = value.right if ast.unparse(value.left) == ast.unparse(target) else value.left
            if (
                self.kind(other) is Kind.LOSS
                and self.long_lived(target)[0]
                and not self.feeds_backward(target)
            ):
                self.report(stmt, target, ast.unparse(other), Kind.LOSS, running=True)
            return
        if (
            isinstance(target, ast.Attribute)
            and isinstance(value, ast.Name)
            and value.id in self.pending
            and self.long_lived(target)[0]
        ):
            # a local list of losses stored into a long-lived place: report its appends
            for node, text in self.pending.pop(value.id):
                self.report(node, target, text, Kind.LOSS)

    def is_fresh_container(self, value: ast.expr) -> bool:
        if isinstance(value, ast.List | ast.Dict | ast.ListComp | ast.DictComp):
            return True
        return isinstance(value, ast.Call) and _tail(value.func) in {
            "list",
            "dict",
            "defaultdict",
            "deque",
            "OrderedDict",
        }

    def augassign(self, s: ast.AugAssign) -> None:
        self.check_calls(s.value)
        target = s.target
        if isinstance(target, ast.Name) and (
            target.id not in self.module.globals
            or (target.id not in self.declared_global and target.id in self.locals)
        ):
            # a local running sum: a loss too, dies with the function
            joined = _join([self.env.kinds.get(target.id), self.kind(s.value)])
            self.env.kinds[target.id] = joined
            return
        if not isinstance(s.op, ast.Add | ast.Sub):
            return
        if self.kind(s.value) is not Kind.LOSS:
            return
        if isinstance(target, ast.Subscript):
            self.sink(target.value, s.value, s)
            return
        ok, _ = self.long_lived(target)
        if ok and not self.feeds_backward(target):
            self.report(s, target, ast.unparse(s.value), Kind.LOSS, running=True)

    def check_calls(self, expr: ast.expr) -> None:
        for node in ast.walk(expr):
            if not isinstance(node, ast.Call):
                continue
            if not isinstance(node.func, ast.Attribute):
                self.follow_helper(node)  # a plain call to a helper: record(loss, losses)
                continue
            method = node.func.attr
            if method in _SINK_METHODS and node.args:
                value = node.args[-1]
                self.sink(node.func.value, value, node)
            elif method == "update":
                # dict.update({...}) / update(k=v) only: metric objects' update(loss)
                # (torchmetrics) run without grad and keep no graph
                values = [a for a in node.args if isinstance(a, ast.Dict)]
                for v in [*values, *(k.value for k in node.keywords if k.arg)]:
                    self.sink(node.func.value, v, node)
            self.follow_helper(node)

    def sink(self, recv: ast.expr, value: ast.expr, node: ast.AST) -> None:
        kind = self.kind(value)
        if kind not in (Kind.LOSS, Kind.FORWARD):
            return
        root, _ = _root(recv)
        if root is not None and root.id in self.env.fresh and root.id not in self.env.aliases:
            # a local list of losses is a loss too (torch.stack(total_losses).sum())
            self.env.kinds[root.id] = _join([self.env.kinds.get(root.id), kind])
            if kind is Kind.LOSS:
                self.pending.setdefault(root.id, []).append((node, ast.unparse(value)))
            return
        ok, names = self.long_lived(recv)
        if not ok or self.is_losslog(recv) or self.feeds_backward(recv):
            return
        if kind is Kind.FORWARD and not _log_like(names):
            return
        self.report(node, recv, ast.unparse(value), kind)

    def report(
        self,
        node: ast.AST,
        recv: ast.expr,
        value: str,
        kind: Kind,
        *,
        running: bool = False,
        via: str = "",
    ) -> None:
        root, path = _root(recv)
        if root is not None and root.id in self.env.aliases:
            symbol = ".".join([_symbol(self.env.aliases[root.id]), *path])
        else:
            symbol = _symbol(recv)
        if running:
            why = (
                f"running sum {symbol} += {value} chains every step's autograd graph into "
                "one that is never freed"
            )
            fix = f"add {value}.detach() (or .item() when you log)"
        else:
            what = "a loss" if kind is Kind.LOSS else "a forward result"
            why = (
                f"{value} ({what}) is kept in {symbol}{via} with its autograd graph and every "
                f"ctx its custom Functions hold, for as long as {symbol} lives"
            )
            fix = f"store {value}.detach() (.item() when you log) or use leakfree.LossLog"
        self.findings.append(self.source.finding(node, CODE, symbol, f"{why}; {fix}"))

    # -- helpers -----------------------------------------------------------------------
    def follow_helper(self, call: ast.Call) -> None:
        name = _tail(call.func)
        if not name or name in _NOT_HELPERS or name[:1].isupper():
            return  # CapWords: a constructor (ModelOutput(loss=loss)), not a storing helper
        func = call.func
        if isinstance(func, ast.Attribute) and not (
            isinstance(func.value, ast.Name) and func.value.id in {self.self_name, "cls"}
        ):
            return  # only plain calls and our own methods: dist.all_reduce(loss) is no helper
        if not any(
            self.kind(a) is Kind.LOSS for a in [*call.args, *(k.value for k in call.keywords)]
        ):
            return  # cheap test first: most calls pass no loss
        candidates = list(self.project.helpers(name))
        local = [(src, h) for src, h in candidates if src is self.source]
        if local:  # names are not resolved: a definition in this file wins
            candidates = local
        # every definition of that name must store the loss (names are not resolved)
        hits = [self.helper_store(call, src, helper) for src, helper in candidates]
        if not hits or any(hit is None for hit in hits):
            return
        recv, arg, container = hits[0]  # type: ignore[misc]
        via = f" by {name}() (as {ast.unparse(container)})"
        self.report(call, recv, ast.unparse(arg), Kind.LOSS, via=via)

    def helper_store(
        self, call: ast.Call, src: Source, helper: FunctionNode
    ) -> tuple[ast.expr, ast.expr, ast.expr] | None:
        """(where it lands, the loss argument, the helper's container) when ``helper``,
        called as ``call``, stores a loss argument in a long-lived container."""
        stored = _stored_params(src, helper)
        if not stored:
            return None
        params = [a.arg for a in (*helper.args.posonlyargs, *helper.args.args)]
        is_method = isinstance(call.func, ast.Attribute)
        offset = 1 if is_method and params and params[0] in {"self", "cls"} else 0
        bound: dict[str, ast.expr] = {}
        for i, arg in enumerate(call.args):
            if isinstance(arg, ast.Starred) or i + offset >= len(params):
                break
            bound[params[i + offset]] = arg
        for kw in call.keywords:
            if kw.arg:
                bound[kw.arg] = kw.value
        for pname, (container, target_param) in stored.items():
            passed = bound.get(pname)
            if passed is None or self.kind(passed) is not Kind.LOSS:
                continue
            if not target_param:
                return container, passed, container  # self.* or a global of the helper
            recv = bound.get(target_param)
            if recv is None:
                continue
            # the container is one of our arguments: long-lived here, or a log by name
            root, _ = _root(recv)
            if root is not None and root.id in self.env.fresh:
                continue
            ok, _ = self.long_lived(recv)
            if not ok and not (isinstance(recv, ast.Name) and _log_like([recv.id])):
                continue
            if self.is_losslog(recv):
                continue
            return recv, passed, container
        return None


_STORED_CACHE: dict[int, tuple[ast.AST, dict[str, tuple[ast.expr, str]]]] = {}
_FACTS_CACHE: dict[int, tuple[ast.AST, _Module]] = {}
_CACHE_LIMIT = 50_000


def _cached(cache: dict[int, tuple[ast.AST, _T]], node: ast.AST) -> _T | None:
    """A per-node memo keyed by identity (the node is kept, so its id is not reused)."""
    hit = cache.get(id(node))
    if hit is not None and hit[0] is node:
        return hit[1]
    if len(cache) > _CACHE_LIMIT:
        cache.clear()
    return None


def _stored_params(source: Source, func: FunctionNode) -> dict[str, tuple[ast.expr, str]]:
    """Parameters ``func`` stores unchanged into a long-lived container or a container
    parameter: name -> (the container expression, the container's root parameter or "")."""
    cached = _cached(_STORED_CACHE, func)
    if cached is not None:
        return cached
    out: dict[str, tuple[ast.expr, str]] = {}
    args = func.args
    params = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    self_name = params[0] if params and params[0] in {"self", "cls"} else None
    module_globals = _module_facts_cached(source).globals
    reassigned = {
        n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    for node in ast.walk(func):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in {"append", "extend", "insert"}
            and node.args
        ):
            continue
        value = node.args[-1]
        if not isinstance(value, ast.Name) or value.id not in params or value.id in reassigned:
            continue
        if value.id == self_name:
            continue
        root, path = _root(node.func.value)
        if root is None:
            continue
        if root.id == self_name and path:
            out[value.id] = (node.func.value, "")
        elif root.id in params and root.id != self_name:
            out[value.id] = (node.func.value, root.id)
        elif root.id in module_globals and root.id not in reassigned:
            out[value.id] = (node.func.value, "")
    _STORED_CACHE[id(func)] = (func, out)
    return out


def _module_facts_cached(source: Source) -> _Module:
    facts = _cached(_FACTS_CACHE, source.tree)
    if facts is None:
        facts = _module_facts(source.tree, source.text)
        _FACTS_CACHE[id(source.tree)] = (source.tree, facts)
    return facts


def _is_autograd_function(cls: ast.ClassDef) -> bool:
    return any(_tail(b) in {"Function", "InplaceFunction"} for b in cls.bases)


_BLOCKS = ("body", "orelse", "finalbody", "handlers", "cases")


def _functions(tree: ast.Module) -> Iterator[tuple[FunctionNode, ast.ClassDef | None]]:
    """Every function with its class (None outside one); autograd Functions are skipped.
    Only statement blocks are visited: functions are defined by statements."""

    def visit(
        block: list[ast.AST], cls: ast.ClassDef | None
    ) -> Iterator[tuple[FunctionNode, ast.ClassDef | None]]:
        for node in block:
            if isinstance(node, ast.ClassDef):
                if not _is_autograd_function(node):
                    yield from visit(list(node.body), node)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield node, cls
                yield from visit(list(node.body), None)
            else:
                for name in _BLOCKS:
                    inner = getattr(node, name, None)
                    if inner:
                        yield from visit(inner, cls)

    yield from visit(list(tree.body), None)


#: Every loss the rule can recognise has one of these in its (lower-cased) text: names,
#: loss callees, torch losses; every forward result one of the next; every store one of
#: _SINK_TEXT. A function with none of them cannot be flagged and is skipped before any walk.
_LOSS_TEXT = ("loss", "criterion", "cross_entropy", "kl_div")
_FORWARD_TEXT = ("logits", "output", "model", "module", "net", "forward", "self(")
_SINK_TEXT = (".append", ".extend", ".insert", ".add", ".update", "+", "]=", "] =", "-=")


def _may_flag(source: Source, func: FunctionNode) -> bool:
    text = "\n".join(source.lines[func.lineno - 1 : func.end_lineno or func.lineno]).lower()
    if any(t in text for t in _LOSS_TEXT):
        return True  # a loss: stored here, or handed to a storing helper
    return any(t in text for t in _FORWARD_TEXT) and any(t in text for t in _SINK_TEXT)


_MODULE_SCOPE = "<module>"


def _module_function(tree: ast.Module) -> ast.FunctionDef:
    """The module's top-level statements as a function without parameters."""
    args = ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[])
    func = ast.FunctionDef(name=_MODULE_SCOPE, args=args, body=tree.body, decorator_list=[])
    func.lineno, func.end_lineno = 1, len(tree.body) and tree.body[-1].end_lineno
    return func


def check(source: Source, project: Project) -> Iterator[Finding]:
    """LF003 over one file: each function, and the module's own statements."""
    text = source.text.lower()
    if not any(t in text for t in (*_LOSS_TEXT, *_FORWARD_TEXT)):
        return
    facts = _module_facts_cached(source)
    if any(t in text for t in _LOSS_TEXT):
        yield from _FunctionScan(source, project, facts, _module_function(source.tree), None).run()
    for func, cls in _functions(source.tree):
        if _may_flag(source, func):
            yield from _FunctionScan(source, project, facts, func, cls).run()


#: the text filter: a file can match only if it names a loss, a loss function or a log-like
#: container ("log" itself is left out: every file that logs anything says it)
_NEEDS = ("Loss", "criterion", *sorted(_LOG_WORDS - {"log"}))

RULES: tuple[Rule, ...] = (
    Rule(
        code=CODE,
        name="loss-kept-with-graph",
        summary=(
            "a loss or forward result is appended or assigned into a container that outlives "
            "the step (self.*, a module global, a context's losses dict) without .detach()"
        ),
        confirm=CONFIRM,
        check=check,
        # a loss-like name, a loss function, or a container word of _LOG_WORDS must appear
        needs=_NEEDS,
    ),
)
