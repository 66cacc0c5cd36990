"""Where LF003 stands inside one function: its parameters, instance, locals and loops,
which containers outlive the step, and how a finding is worded and reported.

:class:`Scope` is what the statement walker of :mod:`~leakfree.scan.rules.kept_losses` knows;
it also follows a loss handed to a helper that stores it (Fast-LLM's
``self._register_loss(name, loss, losses)``)."""

from __future__ import annotations

import ast
import functools

from leakfree.scan._model import Project, ScanFinding, Source
from leakfree.scan._syntax import FunctionNode, name_words, root, symbol, tail, walk
from leakfree.scan.rules._loss_facts import Env, Module, class_backward_attrs, stored_params
from leakfree.scan.rules._loss_kinds import (
    CODE,
    CONTEXT_PARAMS,
    EVAL_WORDS,
    NOT_HELPERS,
    Kind,
    Kinds,
    log_like,
)

#: the name of the module's own statements, read as a function without parameters
MODULE_SCOPE = "<module>"


class Scope(Kinds):
    """One function as LF003 reads it: what it knows of its locals, and its findings."""

    def __init__(
        self,
        source: Source,
        project: Project,
        module: Module,
        func: FunctionNode,
        cls: ast.ClassDef | None,
        depth: int = 0,
    ) -> None:
        self.depth = depth  #: how many helpers deep this function is being read
        self.definitions = module.defined
        self.modules = module.modules
        #: the loops around the statement being read, innermost last
        self.loops: list[ast.For | ast.AsyncFor | ast.While] = []
        #: kinds of what the function returns (collected when read as a helper)
        self.returns: list[Kind | None] = []
        #: id(node) -> the names it backpropagates (see _backwarded)
        self._backward_names: dict[int, frozenset[str]] = {}
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
        self.module_scope = func.name == MODULE_SCOPE
        self.env = Env()
        self.known = self.env.kinds
        self.findings: list[ScanFinding] = []
        #: local fresh containers that received a graph value: name -> (node, kind, value text)
        self.pending: dict[str, list[tuple[ast.AST, str]]] = {}

    @functools.cached_property
    def _scope(self) -> tuple[set[str], set[str]]:
        """(names declared ``global``, names bound locally); only a would-be finding asks."""
        declared: set[str] = set()
        bound: set[str] = set()
        for n in walk(self.func):
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

    def long_lived(self, recv: ast.expr) -> tuple[bool, list[str]]:
        """Whether ``recv`` outlives this call, and the names on its path (for log-likeness)."""
        base, path = root(recv)
        if base is None:
            return False, path
        rid = base.id
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
            if rid in CONTEXT_PARAMS or log_like(names):
                return True, names
        return False, [rid, *path]

    def is_losslog(self, recv: ast.expr) -> bool:
        base, path = root(recv)
        names = ([base.id] if base else []) + path
        return any(n in self.module.losslog_names for n in names)

    def feeds_backward(self, recv: ast.expr) -> bool:
        base, path = root(recv)
        if self.cls is None or base is None or base.id != self.self_name or not path:
            return False
        return path[0] in class_backward_attrs(self.module, self.cls)

    def in_metric_update(self) -> bool:
        """``update`` / ``compute`` of a torchmetrics-style ``Metric`` subclass: torchmetrics
        runs them with grad disabled, so what they keep carries no graph."""
        return (
            self.cls is not None
            and self.func.name in ("update", "compute")
            and any(tail(b).endswith("Metric") for b in self.cls.bases)
        )

    def known_unknown(self, value: ast.expr) -> bool:
        """``x[i]`` / ``x.a`` of a local this function assigned something of unknown kind
        (``mtp_losses = tracker["values"] * scale``): fetching from it says no more."""
        base, _ = root(value)
        return base is not None and base.id in self.known and self.known[base.id] is None

    def is_fresh_container(self, value: ast.expr) -> bool:
        if isinstance(value, ast.List | ast.Dict | ast.ListComp | ast.DictComp):
            return True
        return isinstance(value, ast.Call) and tail(value.func) in {
            "list",
            "dict",
            "defaultdict",
            "deque",
            "OrderedDict",
        }

    def _backwarded(self, node: ast.AST) -> frozenset[str]:
        """The names ``node`` calls ``.backward()`` on (``loss.backward()``: loss), once per
        node for this function."""
        found = self._backward_names.get(id(node))
        if found is None:
            found = self._backward_names[id(node)] = frozenset(
                b.id
                for n in walk(node)
                if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr == "backward"
                for b in [root(n.func.value)[0]]
                if b is not None
            )
        return found

    def sums_backpropagated(self, total: str, s: ast.AugAssign) -> bool:
        """Is ``total += term`` inside a loop that calls ``term.backward()`` each iteration,
        with ``total`` started before the loop and never backpropagated itself? Then every
        iteration's graph stays chained to ``total`` until the loop ends."""
        if not self.loops or not isinstance(s.op, ast.Add):
            return False
        loop = self.loops[0]
        term, _ = root(s.value)
        rebound = any(
            isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == total for t in n.targets)
            for n in walk(loop)
        )
        backwarded = self._backwarded(self.func)
        in_loop = self._backwarded(loop)
        return term is not None and term.id in in_loop and total not in backwarded and not rebound

    def report(
        self,
        node: ast.AST,
        recv: ast.expr,
        value: str,
        kind: Kind,
        *,
        running: bool = False,
        epoch: bool = False,
        via: str = "",
    ) -> None:
        base, path = root(recv)
        if base is not None and base.id in self.env.aliases:
            held = ".".join([symbol(self.env.aliases[base.id]), *path])
        else:
            held = symbol(recv)
        if any(name_words(part) & EVAL_WORDS for part in held.split(".")):
            return  # an evaluation's outputs (``self.validation_step_outputs``): no grad there
        if epoch:
            why = (
                f"running sum {held} += {value} keeps each iteration's graph alive after its "
                f"backward, chained into {held} until the loop ends (the PyTorch FAQ's leak)"
            )
            fix = f"add {value}.item() (or {value}.detach())"
        elif running:
            why = (
                f"running sum {held} += {value} chains every step's autograd graph into "
                "one that is never freed"
            )
            fix = f"add {value}.detach() (or .item() when you log)"
        else:
            what = "a loss" if kind is Kind.LOSS else "a forward result"
            why = (
                f"{value} ({what}) is kept in {held}{via} with its autograd graph and every "
                f"ctx its custom Functions hold, for as long as {held} lives"
            )
            fix = f"store {value}.detach() (.item() when you log) or use leakfree.LossLog"
        self.findings.append(self.source.finding(node, CODE, held, f"{why}; {fix}", evidence=why))

    def follow_helper(self, call: ast.Call) -> None:
        name = tail(call.func)
        if not name or name in NOT_HELPERS or name[:1].isupper():
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
        stored = stored_params(self.project, src, helper)
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
            base, _ = root(recv)
            if base is not None and base.id in self.env.fresh:
                continue
            ok, _ = self.long_lived(recv)
            if not ok and not (isinstance(recv, ast.Name) and log_like([recv.id])):
                continue
            if self.is_losslog(recv):
                continue
            return recv, passed, container
        return None
