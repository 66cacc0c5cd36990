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
from collections.abc import Iterator

from leakfree.scan._callables import autograd_classes
from leakfree.scan._model import Project, ScanFinding, ScanRule, Source
from leakfree.scan._syntax import (
    FunctionNode,
    defined,
    functions,
    name_words,
    root,
    tail,
    walk,
)
from leakfree.scan.rules._loss_facts import (
    module_facts_cached,
)
from leakfree.scan.rules._loss_kinds import (
    CODE,
    DATA_CLASSES,
    LOG_WORDS,
    NO_GRAD_STEPS,
    SINK_METHODS,
    Kind,
    is_lookup,
    is_no_grad_decorated,
    is_no_grad_with,
    join,
    log_like,
    name_kind,
)
from leakfree.scan.rules._loss_scope import MODULE_SCOPE, Scope

__all__ = ["RULES"]

#: words naming metric objects, whose ``update(...)`` runs without grad (torchmetrics)
_METRIC_WORDS = frozenset({"metric", "metrics", "meter", "meters"})

CONFIRM = "leakfree.diagnostics.find_retained"


class _FunctionScan(Scope):
    """One function's statements in source order, tracking local kinds and aliases."""

    def run(self) -> list[ScanFinding]:
        if is_no_grad_decorated(self.func) or NO_GRAD_STEPS.match(self.func.name):
            return []
        if self.in_metric_update():
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
            if any(is_no_grad_with(i) for i in s.items):
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
        if isinstance(s, ast.For | ast.AsyncFor | ast.While):
            if not isinstance(s, ast.While):
                for n in walk(s.target):
                    if isinstance(n, ast.Name):
                        self.env.kinds[n.id] = None
            self.loops.append(s)
            self.block(s.body)
            self.loops.pop()
            self.block(s.orelse)
            return
        if isinstance(s, ast.If):
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
        if isinstance(s, ast.Return):
            if s.value is not None:
                self.check_calls(s.value)
            self.returns.append(self.kind(s.value) if s.value is not None else Kind.CLEAN)

    def forget_assigned(self, body: list[ast.stmt]) -> None:
        """Names assigned under no_grad carry no graph."""
        for stmt in body:
            for n in walk(stmt):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    self.env.kinds[n.id] = Kind.CLEAN

    def assign(self, target: ast.expr, value: ast.expr, stmt: ast.stmt) -> None:
        if isinstance(target, ast.Name):
            kind = self.kind(value)
            if name_kind(target.id) is Kind.LOSS and (
                kind is Kind.FORWARD
                or (
                    kind is None
                    and isinstance(value, ast.Call | ast.Subscript | ast.Attribute)
                    and not is_lookup(value)
                    and not self.known_unknown(value)
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
                        join([name_kind(t.id)])
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

    def augassign(self, s: ast.AugAssign) -> None:
        self.check_calls(s.value)
        target = s.target
        if isinstance(target, ast.Name) and (
            target.id not in self.module.globals
            or (target.id not in self.declared_global and target.id in self.locals)
        ):
            # a local running sum: a loss too, and dies with the function, unless the loop
            # around it backpropagates each term (the PyTorch FAQ's ``total_loss += loss``)
            if self.kind(s.value) is Kind.LOSS and self.sums_backpropagated(target.id, s):
                self.report(s, target, ast.unparse(s.value), Kind.LOSS, running=True, epoch=True)
            joined = join([self.env.kinds.get(target.id), self.kind(s.value)])
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

    def helper_kind(self, call: ast.Call) -> Kind | bool | None:
        """The kind a helper returns, read from its definition (nested in this function,
        else in this file, else the one of that name in the project) with its parameters
        given the kinds of the call's arguments; False when it cannot be read."""
        name = tail(call.func)
        if self.depth >= 2 or not name:
            return False
        if isinstance(call.func, ast.Attribute) and not (
            isinstance(call.func.value, ast.Name) and call.func.value.id == self.self_name
        ):
            return False
        nested = self.nested.get(name, [])
        found = [(self.source, fn) for fn in nested or self.project.defs(self.source).get(name, [])]
        found = found or list(self.project.helpers(name))
        if len(found) != 1:
            return False
        src, fn = found[0]
        params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
        if isinstance(call.func, ast.Attribute) and params:
            params = params[1:]
        given = [(p, self.kind(a)) for p, a in zip(params, call.args)]

        def read() -> Kind | None:
            facts = self.module if src is self.source else module_facts_cached(self.project, src)
            reader = _FunctionScan(src, self.project, facts, fn, None, self.depth + 1)
            reader.known.update(given)
            reader.block(fn.body)
            if not reader.returns:
                return Kind.CLEAN  # returns None
            return join(reader.returns)

        # a helper is called many times with the same kinds (a model zoo's loss helpers)
        return self.project.memo(f"returns {self.depth} {given}", src, fn, read)

    @functools.cached_property
    def nested(self) -> dict[str, list[FunctionNode]]:
        """The functions defined inside this one, by name (read once, not per call)."""
        found: dict[str, list[FunctionNode]] = {}
        for n in defined(self.func.body):
            found.setdefault(n.name, []).append(n)
        return found

    def check_calls(self, expr: ast.expr) -> None:
        for node in walk(expr):
            if not isinstance(node, ast.Call):
                continue
            if not isinstance(node.func, ast.Attribute):
                self.follow_helper(node)  # a plain call to a helper: record(loss, losses)
                continue
            method = node.func.attr
            if method in SINK_METHODS and node.args:
                value = node.args[-1]
                self.sink(node.func.value, value, node)
            elif method == "update" and not name_words(tail(node.func.value)) & _METRIC_WORDS:
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
        base, _ = root(recv)
        if base is not None and base.id in self.env.fresh and base.id not in self.env.aliases:
            # a local list of losses is a loss too (torch.stack(total_losses).sum())
            self.env.kinds[base.id] = join([self.env.kinds.get(base.id), kind])
            if kind is Kind.LOSS:
                self.pending.setdefault(base.id, []).append((node, ast.unparse(value)))
            return
        ok, names = self.long_lived(recv)
        if not ok or self.is_losslog(recv) or self.feeds_backward(recv):
            return
        if kind is Kind.FORWARD and not log_like(names):
            return
        self.report(node, recv, ast.unparse(value), kind)


_LOSS_TEXT = ("loss", "criterion", "cross_entropy", "kl_div")
_FORWARD_TEXT = ("logits", "output", "model", "module", "net", "forward", "self(")
_SINK_TEXT = (".append", ".extend", ".insert", ".add", ".update", "+", "]=", "] =", "-=")


_NEWLINE = re.compile("\n")
#: a forward result (not a loss) is reported only into a container named like a log
_FORWARD_LOG_WORDS = LOG_WORDS - {"loss", "losses"}
#: one of them as a word of a function's text (identifiers split at underscores): one
#: search, stopping at the first, instead of listing every word
_FORWARD_LOG = re.compile(
    r"(?<![a-z0-9])(?:" + "|".join(sorted(_FORWARD_LOG_WORDS, reverse=True)) + r")(?![a-z0-9])"
)


def _may_flag(text: str, losses: bool = True, forwards: bool = True) -> bool:
    """Can this function's text (lower-cased) hold a finding? ``losses`` / ``forwards``
    off: the file's text already rules that branch out."""
    if losses and any(t in text for t in _LOSS_TEXT):
        return True  # a loss: stored here, or handed to a storing helper
    # else only a forward result into a log-named container can be reported: that name
    # is in the text (three in four functions of a model zoo stop here)
    return (
        forwards
        and any(t in text for t in _FORWARD_TEXT)
        and any(t in text for t in _SINK_TEXT)
        and _FORWARD_LOG.search(text) is not None
    )


def _module_function(tree: ast.Module) -> ast.FunctionDef:
    """The module's top-level statements as a function without parameters."""
    args = ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[])
    func = ast.FunctionDef(name=MODULE_SCOPE, args=args, body=tree.body, decorator_list=[])
    func.lineno, func.end_lineno = 1, len(tree.body) and tree.body[-1].end_lineno
    return func


def check(source: Source, project: Project) -> Iterator[ScanFinding]:
    """LF003 over one file: each function, and the module's own statements."""
    text = source.text.lower()
    losses = any(t in text for t in _LOSS_TEXT)
    # a forward result can be reported only where a log-named container is written
    forwards = _may_flag(text, losses=False)
    if not (losses or forwards):
        return
    facts = module_facts_cached(project, source)
    if losses:
        yield from _FunctionScan(source, project, facts, _module_function(source.tree), None).run()
    # inside an autograd Function, ctx is LF001's business (a file without a static
    # method defines none; the look-up waits for the first method worth reading)
    autograd: set[int] | None = None if "staticmethod" in source.text else set()
    # where each line starts (ast counts lines by "\n"): a function's text is one slice
    starts = [0, *(m.end() for m in _NEWLINE.finditer(source.text)), len(source.text)]
    # the lower-cased text is sliced where lower-casing kept every offset (ASCII does)
    same = len(text) == len(source.text)
    for func, cls in functions(source.tree):
        if cls is not None and DATA_CLASSES.search(cls.name):
            continue  # a data set builds its features once, never with grad
        end = min(func.end_lineno or func.lineno, len(starts) - 1)
        begin, stop = starts[func.lineno - 1], starts[end]
        body = text[begin:stop] if same else source.text[begin:stop].lower()
        if not _may_flag(body, losses, forwards):
            continue
        if cls is not None and autograd is None:
            autograd = {id(fc.node) for fc in autograd_classes(project, source)}
        if cls is None or id(cls) not in autograd:  # type: ignore[operator]
            yield from _FunctionScan(source, project, facts, func, cls).run()


#: the text filter: a file can match only if it names a loss, a loss function or a log-like
#: container ("log" itself is left out: every file that logs anything says it)
_NEEDS = ("Loss", "criterion", *sorted(LOG_WORDS - {"log"}))

RULES: tuple[ScanRule, ...] = (
    ScanRule(
        code=CODE,
        name="loss-kept-with-graph",
        summary=(
            "a loss or forward result is appended or assigned into a container that outlives "
            "the step (self.*, a module global, a context's losses dict) without .detach()"
        ),
        confirm=CONFIRM,
        check=check,
        # a loss-like name, a loss function, or a container word of LOG_WORDS must appear
        needs=_NEEDS,
        fix="store .detach() (or .item() where you log), or log into leakfree.LossLog",
    ),
)
