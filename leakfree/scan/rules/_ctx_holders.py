"""LF001's decision for one Function: which ctx attributes hold tensors that nothing
releases, and why.

Every store of an attribute counts (:mod:`~leakfree.scan.rules._ctx_stores`): forward's,
setup_context's, backward's, their helpers', and the parts an object or dict kept on ctx is
given. A store holds tensors on evidence (:class:`~leakfree.scan._tensors.TensorEvidence`
of the function that makes it), with what backward does with a value forward alone does
not place (:mod:`~leakfree.scan.rules._ctx_uses`), the gradients backward returns for
forward's inputs, the fields a kept object's class holds tensors in
(:mod:`~leakfree.scan._fields`), and what the Function's callers hand it where its
annotation says otherwise (:mod:`~leakfree.scan._callers`).

Released, where it happens:

* the whole attribute, by this Function's backward (set to ``None``, deleted, cleared,
  popped: :class:`~leakfree.scan.rules._ctx_releases.Releases`);
* a part (a field, a key, the items), by a clear of that part in the code of the
  Functions that share the object (:func:`~leakfree.scan.rules._ctx_stores.partners`): a
  part given in a forward is released by a clear in any of their methods (the pair's
  forward takes it out), a part given in a backward only by a clear in a backward.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field

from leakfree.scan._callables import ReturnReader, imported_names
from leakfree.scan._callers import SCALAR, TENSOR, Callers
from leakfree.scan._fields import Fields
from leakfree.scan._flow import Flow
from leakfree.scan._model import Project, Source
from leakfree.scan._syntax import (
    FunctionClass,
    FunctionNode,
    annotated_class,
    attr_of,
    bindings,
    class_named,
    elements,
    own_nodes,
    parameters,
    plain_annotation,
    resolve,
    tail,
    tensor_annotation,
)
from leakfree.scan._tensors import (
    META_ATTRS,
    META_BUILTINS,
    META_METHODS,
    TensorEvidence,
    handle_named,
    metadata_named,
)
from leakfree.scan.rules._ctx_releases import ALL, Part, Releases
from leakfree.scan.rules._ctx_stores import (
    BACKWARD,
    FORWARD,
    Store,
    ctx_param,
    kept_parameter,
    stores,
)
from leakfree.scan.rules._ctx_uses import (
    BackwardUses,
    Uses,
    gradient_inputs,
    kept_elements,
    op_key,
)


@dataclass
class Verdict:
    """An attribute that keeps tensors nothing releases: the store to report at, why it
    holds tensors, the part that keeps them (``myreq.tensor``) and who stores it."""

    store: Store
    because: str
    part: str | None = None
    by: str = FORWARD


@dataclass
class Tools:
    """What every Function of one file is judged with (built once per file), and what is
    read once per file: each method's stores, each Function's decision, who keeps what."""

    source: Source
    project: Project
    names: dict[str, str]
    releases: Releases
    returns: ReturnReader
    classes: list[FunctionClass]
    fields: Fields
    callers: Callers
    _stores: dict[int, list[Store]] = field(default_factory=dict)
    _holders: dict[int, Holders | None] = field(default_factory=dict)
    _keepers: dict[tuple[str, str], list[FunctionClass]] | None = None
    #: id(function) -> (the function, its flow): the function is kept so its id stays its
    _flows: dict[int, tuple[FunctionNode, Flow]] = field(default_factory=dict)
    _bound: dict[str, list[str]] | None = None

    def script_class(self, full: str) -> bool:
        """Does the dotted name ``full`` (an annotation, resolved through the file's
        imports) name a TorchScript class: ``torch.classes.*``, or a module-level name
        bound to one here or in the module of the scanned tree it is imported from?"""
        if full.startswith("torch.classes."):
            return True
        if self._bound is None:
            self._bound = bindings(self.source.tree, self.names)
        if any(b.startswith("torch.classes.") for b in self._bound.get(full, ())):
            return True
        module, _, name = full.rpartition(".")
        other = self.project.module(module) if module else None
        if other is None:
            return False
        there = bindings(other.tree, imported_names(self.project, other)).get(name, ())
        return any(b.startswith("torch.classes.") for b in there)

    def flow(self, fn: FunctionNode) -> Flow:
        """The :class:`~leakfree.scan._flow.Flow` of ``fn``, made once."""
        found = self._flows.get(id(fn))
        if found is None:
            found = self._flows[id(fn)] = (fn, Flow(fn))
        return found[1]

    def stores(self, fn: FunctionNode, param: str, half: str) -> list[Store]:
        """:func:`~leakfree.scan.rules._ctx_stores.stores`, once per method."""
        found = self._stores.get(id(fn))
        if found is None:
            found = self._stores[id(fn)] = list(
                stores(fn, param, half, self.project, self.source, flow=self.flow(fn))
            )
        return found

    def holders(self, fc: FunctionClass) -> Holders | None:
        """:meth:`Holders.of`, once per Function."""
        if id(fc) not in self._holders:
            self._holders[id(fc)] = Holders.of(fc, self)
        return self._holders[id(fc)]

    def partners(self, fc: FunctionClass, attr: str, param: str) -> list[FunctionClass]:
        """The other Functions of the file that keep a parameter named ``param`` in
        ``ctx.attr`` too (:func:`~leakfree.scan.rules._ctx_stores.partners`, indexed once
        per file)."""
        if self._keepers is None:
            self._keepers = {}
            for other in self.classes:
                for key in _kept(other, self):
                    self._keepers.setdefault(key, []).append(other)
        return [o for o in self._keepers.get((attr, param), []) if o is not fc]


@dataclass
class Holders:
    """The LF001 decision for one Function (see the module's docstring)."""

    fc: FunctionClass
    entry: FunctionNode
    setup: bool
    back: FunctionNode
    tools: Tools
    _evidence: dict[int, TensorEvidence] = field(default_factory=dict)
    _uses: Uses | None = None

    def verdicts(self, skip: set[str]) -> Iterator[Verdict]:
        """One :class:`Verdict` per attribute (not in ``skip``) that keeps tensors."""
        t = self.tools
        entry_ctx, back_ctx = ctx_param(self.entry), ctx_param(self.back)
        if entry_ctx is None or back_ctx is None:
            return
        released = t.releases.of(self.back, back_ctx)
        if ALL in released:
            return
        own = [
            *t.stores(self.entry, entry_ctx, FORWARD),
            *t.stores(self.back, back_ctx, BACKWARD),
        ]
        done = set(skip) | set(released)
        for s in own:
            if s.attr in done:
                continue
            verdict = self._attribute(s.attr, [x for x in own if x.attr == s.attr], entry_ctx)
            done.add(s.attr)
            if verdict is not None:
                yield verdict

    # -- one attribute -------------------------------------------------------------------
    def _attribute(self, attr: str, own: list[Store], entry_ctx: str) -> Verdict | None:
        whole = [s for s in own if s.part is None]
        for s in whole:
            because = self._because(s)
            if because is not None:
                return Verdict(s, because, by=s.half)
        kept = kept_parameter(self.entry, self.tools.flow(self.entry).aliases(entry_ctx), attr)
        pair = self.tools.partners(self.fc, attr, kept) if kept else []
        judges = [j for j in map(self.tools.holders, pair) if j is not None]
        at = whole[0] if whole else own[0]
        if all(s.part is None for s in own) and not any(any(j.parts(attr)) for j in judges):
            return self._class_fields(attr, at, kept, set(), set())  # no part anywhere
        fwd_clear, back_clear = self._cleared(attr, pair)
        candidates = [(s, self, s.half) for s in own]
        for judge in judges:
            if judge is not None:
                by = judge.fc.node.name
                candidates += [(s, judge, f"{by}'s {s.half}") for s in judge.parts(attr)]
        # what a forward writes into the object it was handed is the caller's business,
        # unless this code manages the object's fields (a handoff between Functions,
        # torchrec's Request: someone clears them)
        managed = any(kind == "field" for kind, _ in fwd_clear | back_clear)
        for s, judge, by in candidates:
            if s.part is None or _released(s.part, s.half, fwd_clear, back_clear):
                continue
            if s.through_name and s.half == FORWARD and not managed:
                continue
            because = judge._because(s)
            if because is not None:
                return Verdict(at, because, _part(attr, s.part), by)
        return self._class_fields(attr, at, kept, fwd_clear, back_clear)

    def _class_fields(
        self,
        attr: str,
        at: Store,
        kept: str | None,
        fwd_clear: set[Part],
        back_clear: set[Part],
    ) -> Verdict | None:
        """A kept parameter annotated with a class of the tree whose fields hold tensors
        of real size that nobody clears."""
        if kept is None or at.part is not None:
            return None
        (p,) = [p for p in parameters(self.entry) if p.arg == kept]
        cls = annotated_class(p.annotation)
        fields = self.tools.fields
        found = fields.of(self.tools.source, cls) if cls else None
        if not found or not fields.carrier(self.tools.source, cls):  # type: ignore[arg-type]
            return None  # a service object (a device mesh) lives on its own
        left = [
            f
            for f in found.values()
            if not f.small and not _released(("field", f.name), FORWARD, fwd_clear, back_clear)
        ]
        if not left:
            return None
        named = ", ".join(f"{kept}.{f.name}" for f in left)
        return Verdict(at, f"{left[0].why}", named, FORWARD)

    def _cleared(self, attr: str, pair: list[FunctionClass]) -> tuple[set[Part], set[Part]]:
        """Parts of ``attr``'s object cleared in a forward, and in a backward, of this
        Function or of those that share it."""
        fwd: set[Part] = set()
        back: set[Part] = set()
        for fc in [self.fc, *pair]:
            for name, into in (("setup_context", fwd), ("forward", fwd), ("backward", back)):
                fn = fc.method(name)
                param = ctx_param(fn) if fn is not None else None
                if fn is not None and param is not None:
                    into |= self.tools.releases.parts(fn, param).get(attr, set())
        return fwd, back

    @classmethod
    def of(cls, fc: FunctionClass, tools: Tools) -> Holders | None:
        """The decision for ``fc``, None when it has no forward ctx or no backward."""
        entry = fc.method("setup_context")
        setup = entry is not None and bool(parameters(entry))
        if not setup:
            entry = fc.method("forward")
        back = fc.method("backward") or fc.method("vjp")
        if entry is None or back is None or ctx_param(entry) is None or ctx_param(back) is None:
            return None
        return cls(fc, entry, setup, back, tools)

    def parts(self, attr: str) -> Iterator[Store]:
        """The parts this Function's code gives ``attr``'s object (for a partner)."""
        t = self.tools
        for fn, half in ((self.entry, FORWARD), (self.back, BACKWARD)):
            param = ctx_param(fn)
            if param is not None:
                for s in t.stores(fn, param, half):
                    if s.attr == attr and s.part is not None:
                        yield s

    # -- does one store hold tensors? -----------------------------------------------------
    def _because(self, s: Store) -> str | None:
        """Why ``s`` holds tensors, or None when it does not on the evidence."""
        if s.part is None and s.half == FORWARD and metadata_named(s.attr, s.value):
            return None
        if isinstance(s.value, ast.Name) and handle_named(s.value.id):
            return None  # a communication handle, an event, a stream: not a tensor
        if _plain_value(s.value) or self._script_object(s):
            return None  # what the evidence would say, without building it
        evidence = self._evidence_of(s.fn, s.ctx)
        if evidence.holds(s.value, excluded=s.not_tensors):
            if (
                s.index is not None
                and isinstance(s.value, ast.Call)
                and self.tools.returns.plain(s.value, evidence, s.index)
            ):
                return None  # ``o, lse, ctx.scale = helper(q)``: the helper's third is a float
            return evidence.explain(s.value)
        if s.half != FORWARD or s.fn is not self.entry:
            return None
        uses = self._backward_uses()
        for index, leaf in kept_elements(s.value):
            if not _passed_through(leaf, evidence):
                continue
            why = uses.get((s.attr, index))
            if why is None and index is None:
                # a name kept whole (``ctx.args = expanded_args``): an element backward
                # unpacks and uses as a tensor is one it holds
                why = next((w for (a, _), w in uses.items() if a == s.attr), None)
            if why is not None:
                return why
        return None

    def _script_object(self, s: Store) -> bool:
        """Is the kept value a forward parameter annotated as a TorchScript class
        (``projection: PinholeProjection`` with ``PinholeProjection =
        torch.classes.gsplat_sensors.OpenCVPinholeProjection``)? Opaque: no tensor, no
        gradient, nothing backward can use as one."""
        if not (isinstance(s.value, ast.Name) and s.fn is self.entry):
            return False
        ann = next((p.annotation for p in parameters(self.entry) if p.arg == s.value.id), None)
        if ann is None:
            return False
        full = resolve(ann, self.tools.names) or ""
        return self.tools.script_class(full)

    def _evidence_of(self, fn: FunctionNode, ctx: frozenset[str]) -> TensorEvidence:
        found = self._evidence.get(id(fn))
        if found is None:
            found = self._evidence[id(fn)] = self._build(fn, set(ctx))
        return found

    def _build(self, fn: FunctionNode, ctx: set[str]) -> TensorEvidence:
        t = self.tools
        flow = t.flow(fn)
        if fn is not self.entry:
            grads: list[str] = []
            if fn is self.back:
                grads = [p.arg for p in parameters(fn) if p.arg not in ctx and p.arg != "cls"]
                if fn.args.vararg is not None:
                    grads.append(fn.args.vararg.arg)
            return TensorEvidence(
                fn, t.names, ctx, flow=flow, inputs=False, returned=False, seed=grads,
                callee=t.returns.returns,
            )  # fmt: skip
        reasons = gradient_inputs(self.entry, self.back, self.setup)
        scalars: set[str] = set()
        kept = {param for _, param in _kept(self.fc, t)}  # the callers matter only for these
        for i, p in enumerate(parameters(fn)[0 if self.setup else 1 :]):
            annotated = plain_annotation(p.annotation) or tensor_annotation(p.annotation)
            if p.arg not in kept or not annotated:
                continue
            said = t.callers.verdict(self.fc.node.name, i)
            if said == SCALAR:
                scalars.add(p.arg)
                reasons.pop(p.arg, None)
            elif said == TENSOR:
                reasons.setdefault(p.arg, f"every caller hands {p.arg} a tensor")
        typed = self._typed(fn, flow)
        return TensorEvidence(
            fn, t.names, ctx, flow=flow, callee=t.returns.returns, reasons=reasons,
            scalars=scalars, fields=typed,
        )  # fmt: skip

    def _typed(self, fn: FunctionNode, flow: Flow) -> dict[str, frozenset[str]]:
        """Name -> the tensor fields of its class, for the names whose class the code
        says: a parameter's annotation (``pattern: Sparse24Tensor``), a constructor call,
        or a helper's return annotation (``out = _sparsify24_forward(x)`` with ``->
        Sparse24Tensor``)."""
        t = self.tools
        classes: dict[str, str] = {}
        for p in parameters(fn):
            name = class_named(p.annotation)
            if name:
                classes[p.arg] = name
        for target, value, _ in flow.assigned():
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
                callee = value.func.id
                if callee[:1].isupper():
                    classes[target] = callee
                    continue
                local = t.project.defs(t.source).get(callee, [])
                defs = local or [f for _, f in t.project.helpers(callee)]
                if len(defs) == 1 and (name := class_named(defs[0].returns)):
                    classes[target] = name
        typed: dict[str, frozenset[str]] = {}
        for name, cls in classes.items():
            found = t.fields.of(t.source, cls)
            if found:
                typed[name] = frozenset(found)
        return typed

    def _backward_uses(self) -> Uses:
        if self._uses is None:
            param = ctx_param(self.back)
            made = _made(self.entry, ctx_param(self.entry) or "", self.tools.flow(self.entry))
            uses = BackwardUses(self.tools.source, self.tools.project, self.tools.names, made)
            self._uses = uses.of(self.back, param) if param else {}
        return self._uses


def _kept(fc: FunctionClass, tools: Tools) -> Iterator[tuple[str, str]]:
    """(attribute, parameter) for each forward parameter ``fc`` keeps whole on ctx."""
    entry = fc.method("setup_context") or fc.method("forward")
    name = ctx_param(entry) if entry is not None else None
    if entry is None or name is None:
        return
    ctx = tools.flow(entry).aliases(name)
    params = {p.arg for p in parameters(entry)}
    for n in own_nodes(entry):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name) and n.value.id in params:
            for t in n.targets:
                attr = attr_of(t, ctx)
                if attr is not None:
                    yield attr, n.value.id


def _made(fn: FunctionNode, param: str, flow: Flow) -> dict[str, tuple[str, ...]]:
    """Attribute -> the compiled op whose result forward keeps in it (``out, n = fw(x);
    ctx.n = n``). A result whose siblings forward hands to ``ctx.save_for_backward`` while
    keeping it apart is not one: save_for_backward takes tensors, and the author sorted
    them (Liger's ``chosen_tile_m``, an int beside six saved tensors)."""
    ctx = flow.aliases(param)
    saved: set[str] = set()
    for n in own_nodes(fn):
        if isinstance(n, ast.Call) and tail(n.func) == "save_for_backward":
            for a in n.args:
                v = a.value if isinstance(a, ast.Starred) else a
                if isinstance(v, ast.Name):
                    saved.add(v.id)
    results: dict[str, ast.Call] = {}
    for s in flow.steps:
        if s.how == "=" and isinstance(s.target, ast.Name) and isinstance(s.value, ast.Call):
            siblings = {
                e.id
                for t in getattr(s.node, "targets", ())
                for e in elements(t)
                if isinstance(e, ast.Name)
            }
            if not (siblings - {s.target.id}) & saved:
                results[s.target.id] = s.value
    out: dict[str, tuple[str, ...]] = {}
    for s in flow.steps:
        attr = attr_of(s.target, ctx)
        if attr and isinstance(s.value, ast.Name) and s.value.id in results:
            key = op_key(results[s.value.id], fn)
            if key:
                out[attr] = key
    return out


def _plain_value(value: ast.AST) -> bool:
    """A value no evidence makes a tensor: a literal, ``int(...)`` / ``len(...)``, a
    tensor's metadata (``x.shape``, ``x.size(0)``, ``x.shape[1]``)."""
    if isinstance(value, ast.Constant):
        return True
    if isinstance(value, ast.Subscript):
        return _plain_value(value.value)
    if isinstance(value, ast.Attribute):
        return value.attr in META_ATTRS
    if isinstance(value, ast.Call):
        func = value.func
        if isinstance(func, ast.Name):
            return func.id in META_BUILTINS
        return isinstance(func, ast.Attribute) and func.attr in META_METHODS
    return False


def _passed_through(value: ast.AST, evidence: TensorEvidence) -> bool:
    """Is ``value`` a name forward neither shows to be a tensor nor to be a number (a
    parameter handed straight to ctx, what an unknown call returned): what backward does
    with it then decides."""
    return (
        isinstance(value, ast.Name)
        and value.id not in evidence.plain
        and value.id not in evidence.literals
    )


def _released(part: Part, half: str, fwd_clear: set[Part], back_clear: set[Part]) -> bool:
    everything = ("item", None)
    cleared = back_clear | (fwd_clear if half == FORWARD else set())
    return part in cleared or (part[0] != "field" and everything in cleared)


def _part(attr: str, part: Part) -> str:
    kind, name = part
    if kind == "field":
        return f"ctx.{attr}.{name}"
    if kind == "key":
        return f'ctx.{attr}["{name}"]'
    return f"the items of ctx.{attr}"
