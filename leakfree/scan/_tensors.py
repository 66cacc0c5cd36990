"""Can this value hold tensors? The one inference every rule asks, on evidence only.

:class:`TensorEvidence` is built on :class:`~leakfree.scan._flow.Flow`. It is one-sided on
purpose: it answers *yes* only on evidence (a ``torch`` call, a tensor method, a name the
code itself treats as a tensor, a helper whose body returns one...) and *no* otherwise, so
a rule built on it stays quiet on values it cannot see into. Each name it believes holds
tensors keeps its reason, so a finding can say why.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Mapping

from leakfree.scan._flow import Flow, Reason, Step, said, short, tensor_test
from leakfree.scan._syntax import (
    FunctionNode,
    calls_on,
    elements,
    name_words,
    own_nodes,
    parameters,
    plain_annotation,
    resolve,
    tensor_annotation,
    walk,
    words,
)

# --- can a value hold tensors? --------------------------------------------------------

#: attributes of a tensor that are plain metadata
META_ATTRS = words(
    "shape dtype device ndim requires_grad is_cuda is_leaf layout is_sparse is_quantized "
    "is_meta names itemsize nbytes is_nested _version is_cpu is_mps is_xpu grad_fn"
)
#: methods of a tensor that return metadata (numbers, bools, sizes, strings)
META_METHODS = words(
    "size dim numel stride item tolist data_ptr is_contiguous element_size get_device "
    "nelement storage_offset is_floating_point is_complex ndimension is_pinned is_shared "
    "is_set_to __len__ is_signed is_inference type"
)
#: attribute uses that only a tensor (or a tensor-like storage object) has
TENSOR_USES = words(
    "view reshape contiguous numel requires_grad data_ptr transpose is_contiguous stride "
    "is_cuda element_size new_empty new_zeros new_ones new_full narrow unsqueeze squeeze "
    "expand permute detach requires_grad_ untyped_storage masked_fill matmul mm bmm "
    "view_as expand_as reshape_as copy_ zero_ fill_ add_ mul_ grad_fn _base storage clone "
    "T mT"
)
#: builtins whose result holds no tensor, whatever they are given
META_BUILTINS = words(
    "len isinstance issubclass int float bool str type id hash repr range hasattr "
    "callable getattr format abs round object super print any all ord chr bytes frozenset"
)
#: builtins that build containers of their arguments' elements
CONTAINER_BUILTINS = words(
    "list tuple set dict sorted reversed zip enumerate iter next max min map filter"
)
#: modules whose functions return tensors (except the metadata ones below)
TORCH_TENSOR_MODULES = words(
    "torch torch.nn.functional torch.linalg torch.fft torch.special torch.sparse "
    "torch.nested torch._C._nn torch._C._VariableFunctions"
)
_TORCH_META_PREFIXES = (
    "is_", "get_default", "get_autocast", "current_", "set_", "device", "get_device",
    "default_", "_is", "are_", "use_", "compiled_with", "get_num", "typename",
)  # fmt: skip
_TORCH_META = words(
    "dtype Size finfo iinfo result_type promote_types numel equal no_grad enable_grad "
    "inference_mode Generator Stream Event stream autocast empty_cache manual_seed seed "
    "initial_seed can_cast sym_int sym_float sym_max sym_min broadcast_shapes"
)
#: attributes of a tensor (or of a storage object) that are tensors
TENSOR_ATTRS = frozenset({"T", "mT", "H", "mH", "data", "grad", "real", "imag", "_base"})
#: torch functions whose positional arguments are sizes or data, not tensors
FACTORIES = words(
    "zeros ones empty full arange range tensor as_tensor rand randn randint randperm "
    "linspace logspace eye from_numpy empty_strided scalar_tensor frombuffer asarray "
    "normal bernoulli"
)
#: ctx methods whose arguments are tensors
_SAVES = ("save_for_backward", "mark_dirty", "save_for_forward")
#: ctx attributes that give back what save_for_backward kept
_SAVED = ("saved_tensors", "saved_variables")
#: words that name metadata (``ctx.grad_shape``, ``s_dtype``, ``index_strides``)
META_WORDS = words(
    "dtype dtypes shape shapes size sizes stride strides layout layouts spec specs ndim "
    "dims numel device devices len lens length lengths rank ranks world mode flag flags "
    "kind config cfg dtype_a offsets_meta sig signature"
)
#: words that name tensors, for the elements of ``a, b = f(x)``
TENSOR_WORDS = words("tensor tensors args inputs outputs activations buffers grads")
#: what a forward's first input is called when it is the tensor the node transforms (a
#: first parameter of another name is as often a flag, a callable or a config)
_INPUT_NAMES = words(
    "x x_ inp input input_ inputs tensor hidden hidden_states query q act activation activations"
)


def _tensor_attr(name: str) -> bool:
    if "meta" in name:
        return False  # _metadata_cache, fp8_meta: bookkeeping beside the data
    return name in TENSOR_ATTRS or "data" in name or "tensor" in name or "mask" in name


#: last words naming a forward's parameter for the tensor it is (``attention_mask``,
#: ``hidden_states``, ``router_logits``); a default number or a plain annotation wins
_TENSOR_PARAM_WORDS = words("mask masks states logits probs logp logprobs indices seqlens")
#: words naming the tensor fields of an object a call returns (a model layer's output, a
#: sparse tensor's parts)
_TENSOR_FIELD_WORDS = words(
    "mask masks bucket buckets hidden states logits probs scores output outputs grad grads "
    "activation activations tensor tensors bias"
)


def _scalars(fn: FunctionNode, every: list[ast.arg]) -> set[str]:
    """Names the function shows are no tensor: annotated as a plain type (parameters and
    annotated locals), or parameters whose default is a number, a bool or a string
    (``p=0.1``, ``causal=False``), whatever arithmetic they later take part in."""
    plain = {p.arg for p in every if plain_annotation(p.annotation)}
    plain |= {
        n.target.id
        for n in own_nodes(fn)
        if isinstance(n, ast.AnnAssign)
        and isinstance(n.target, ast.Name)
        and plain_annotation(n.annotation)
    }
    plain |= {
        name
        for name, d in _defaults(fn).items()
        if isinstance(d, ast.Constant) and d.value is not None and d.value is not Ellipsis
    }
    return plain


def _last_word(name: str) -> str:
    """What a compound name is (``attn_mask_type`` is a type, ``attention_mask`` a
    mask): its last word, lower-cased."""
    parts = [w for w in name.lower().split("_") if w]
    return parts[-1] if parts else ""


def _defaults(fn: FunctionNode) -> dict[str, ast.expr]:
    """Parameter -> its default value."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    out = {p.arg: d for p, d in zip(positional[len(positional) - len(a.defaults) :], a.defaults)}
    out.update({p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
    return out


def torch_makes_tensor(full: str) -> bool:
    """Does the ``torch`` function of this dotted name return a tensor?"""
    mod, _, fn = full.rpartition(".")
    if fn == "get_rng_state":
        return True  # torch.get_rng_state / torch.cuda.get_rng_state: a state tensor
    if not (mod in TORCH_TENSOR_MODULES or mod.startswith("torch.ops.")):
        return False
    return not (fn in _TORCH_META or fn.startswith(_TORCH_META_PREFIXES) or fn[:1].isupper())


def metadata_named(attr: str, value: ast.AST) -> bool:
    """Does the attribute, or every name the value is made of, name metadata?

    ``ctx.grad_shape = ...``, ``ctx.dtypes = s_dtype, t_dtype``: a name that says shape,
    dtype, stride, layout, spec, device, rank, mode... is taken at its word.
    """
    if name_words(attr) & META_WORDS:
        return True
    names = list(elements(value))
    return bool(names) and all(
        isinstance(v, ast.Name) and name_words(v.id) & META_WORDS for v in names
    )


#: words naming objects that are not tensors: communication handles, events, streams,
#: NumPy arrays (a forward may return them beside its tensors)
HANDLE_WORDS = words(
    "handle handles work works req reqs request requests future futures fut event events "
    "stream streams group np numpy"
)
#: methods whose result is (a view or copy of) the tensor they are called on
_SAME_DATA = words(
    "to float half bfloat16 double cuda cpu contiguous view reshape transpose permute "
    "detach clone t flatten squeeze unsqueeze expand"
)


def handle_named(name: str) -> bool:
    """Does the name say a handle, an event, a stream or a NumPy array (not a tensor)?"""
    return bool(name_words(name) & HANDLE_WORDS)


def _through_views(e: ast.AST) -> ast.Name | None:
    """The name under ``x.to(d).contiguous()`` / ``x[:, :n]``: a tensor-only use of the
    result is one of ``x`` (a slice, not an index: ``ops[i].requires_grad`` is about an
    element of a list)."""
    while True:
        if isinstance(e, ast.Name):
            return e
        if isinstance(e, ast.Subscript) and (
            isinstance(e.slice, ast.Slice)
            or (
                isinstance(e.slice, ast.Tuple)
                and any(isinstance(x, ast.Slice) for x in e.slice.elts)
            )
        ):
            e = e.value
        elif (
            isinstance(e, ast.Call)
            and isinstance(e.func, ast.Attribute)
            and e.func.attr in _SAME_DATA
        ):
            e = e.func.value
        else:
            return None


#: custom ops and TorchScript classes: what they are handed is opaque (a ScriptObject, a
#: handle), not evidence of a tensor; what a custom op returns is a tensor
OPAQUE_CALLS = ("torch.ops.", "torch.classes.")

#: comparisons a tensor makes element by element (``is`` and ``in`` give a bool)
_ELEMENTWISE = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _literal(e: ast.AST) -> bool:
    """A constant, or a display of constants (``{"scale": 2}``, ``(1, 2)``)."""
    try:
        ast.literal_eval(e)  # type: ignore[arg-type]
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _operands(e: ast.AST) -> list[ast.Name]:
    """The names ``e`` is arithmetic of (``a / b``, ``-a``, ``a * 2``); none when any part
    of it is anything else (a call, an attribute): ``torch.round(torch.clamp(x) * n -
    shift)`` says nothing of ``n`` or ``shift``, the call is the tensor."""
    found = _arithmetic(e)
    return found if found is not None else []


def _arithmetic(e: ast.AST) -> list[ast.Name] | None:
    if isinstance(e, ast.Name):
        return [e]
    if isinstance(e, ast.Constant):
        return []
    if isinstance(e, ast.BinOp):
        left, right = _arithmetic(e.left), _arithmetic(e.right)
        return None if left is None or right is None else left + right
    if isinstance(e, ast.UnaryOp) and not isinstance(e.op, ast.Not):
        return _arithmetic(e.operand)
    return None


class TensorEvidence:
    """Which local names of a function hold tensors, on evidence in the function itself,
    each with the reason (:attr:`why`).

    A name holds tensors when the code shows it: it is annotated ``Tensor``; it is passed
    to ``ctx.save_for_backward`` / ``mark_dirty`` / ``save_for_forward``, or first to a
    ``torch`` function (alone or in arithmetic of names: ``torch.round(a / b)``); it is
    used with a tensor-only attribute (``x.view(...)``, ``x.clone()``, ``x.T``...; not
    ``.shape`` or ``.dtype``, which quantization states and specs have too); it is one of
    ``forward``'s inputs (its first parameter after ctx, or its ``*args``) or a name
    ``forward`` returns (``returned``); or it is assigned (appended, extended, stored into)
    from an expression that holds tensors: a ``torch`` function call (bar metadata
    queries), a tensor method or attribute (bar ``.shape``, ``.size()``, ``.item()``...),
    arithmetic, indexing or a container of such values, a loop or comprehension over them
    (a branch guarded by ``torch.is_tensor`` / ``isinstance(..., Tensor)`` is judged by
    its guard), or a call of any other function that is handed one (its result may keep
    it). Tuple targets of a call whose other element is spread into
    ``save_for_backward(*tensors)`` hold tensors too (the ``tensors, objects =
    prepare_for_saving(...)`` split).

    Nothing else does: a name annotated as a number, string, bool, dtype, device or a
    tuple of those (:func:`plain_annotation`), a parameter only passed through, a
    ``self.`` attribute, a constructor without tensor arguments, a parameter the function
    writes tensors into (the caller's object).
    """

    def __init__(
        self,
        fn: FunctionNode,
        names: dict[str, str],
        ctx: set[str],
        *,
        flow: Flow | None = None,
        inputs: bool = True,
        returned: bool = True,
        seed: Iterable[str] = (),
        reasons: Mapping[str, str] | None = None,
        scalars: Iterable[str] = (),
        fields: Mapping[str, frozenset[str]] | None = None,
        callee: Callable[[ast.Call, TensorEvidence, int | None], bool | None] | None = None,
    ) -> None:
        self.names = names
        #: names whose class (read where it is defined) has these fields holding tensors
        self.fields = fields or {}
        #: what a call's callee, read where it is defined, returns (at a position of its
        #: tuple): True a tensor, False none, None unknown
        self.callee = callee
        self.ctx = ctx
        self.flow = flow or Flow(fn)
        va = fn.args.vararg
        every = parameters(fn) + ([va] if va else [])
        # what callers show wins over an annotation (the caller reads the other way round)
        self.plain = (_scalars(fn, every) | set(scalars)) - set(reasons or ())
        why: dict[str, Reason] = {name: f"{name} is handed a tensor" for name in seed}
        self._from_parameters(fn, every, inputs, why)
        # each name's values: names only ever bound to literals (``info = {"scale": 2}``)
        # are no evidence when returned; names bound to what a call other than a torch
        # function returns (``out = layer(...)``) are objects whose fields may be tensors
        bound: dict[str, list[ast.AST]] = {}
        for name, value, _ in self.flow.assigned():
            bound.setdefault(name, []).append(value)
        self.literals = {name for name, values in bound.items() if all(map(_literal, values))}
        self.records = {
            name
            for name, values in bound.items()
            if all(isinstance(v, ast.Call) and not self._tensor_call(v) for v in values)
        }
        groups = self._from_uses(fn, returned, why)
        for plain in self.plain:
            why.pop(plain, None)
        self._params = {p.arg for p in every}
        self._bound = self._params | set(bound)
        self.tensors: set[str] = set(why)
        self.why = self.flow.spread(why, self._carries, self._may_hold)
        # arithmetic none of whose names is known to be a tensor: each may be the one
        # (``torch.round(identity / identity_scaling_factor)``); ``torch.softmax(x *
        # scale)`` with ``x`` a tensor says nothing of ``scale``
        unsure = [
            (o.id, call)
            for group, call in groups
            if not any(o.id in self.why or o.id in self.plain for o in group)
            for o in group
        ]
        if unsure:
            for name, call in unsure:
                why.setdefault(name, f"{name} is passed to {short(call)} at L{call.lineno}")
        # what the function's other code shows (backward's gradients, the callers) comes
        # last: it adds tensors, it does not settle which name of arithmetic is one
        for name, reason in (reasons or {}).items():
            why.setdefault(name, reason)
        if unsure or reasons:
            self.why = self.flow.spread(why, self._carries, self._may_hold)
        self.tensors = set(self.why)

    def _from_parameters(
        self, fn: FunctionNode, every: list[ast.arg], inputs: bool, why: dict[str, Reason]
    ) -> None:
        """Parameters that are tensors by their annotation, or as ``forward``'s inputs
        (its first, its ``*args``, those named for a tensor)."""
        for p in every:
            ann = p.annotation
            skip = p.arg in self.ctx or p.arg in self.plain
            if ann is not None and not skip and tensor_annotation(ann):
                why.setdefault(p.arg, f"{p.arg} is annotated {ast.unparse(ann)}")
        if not (inputs and fn.name == "forward"):
            return
        va = fn.args.vararg
        rest = [p for p in fn.args.posonlyargs + fn.args.args if p.arg not in self.ctx]
        if rest and (rest[0].arg in _INPUT_NAMES or (len(rest) == 1 and va is None)):
            why.setdefault(rest[0].arg, f"{rest[0].arg} is forward's input")
        if va is not None:
            why.setdefault(va.arg, f"*{va.arg} are forward's inputs")
        for p in rest:  # ``attention_mask``, ``hidden_states``: named for what they are
            # (an annotation, ``block_mask: tuple[Any, ...]``, says better)
            if (
                p.annotation is None
                and p.arg not in self.plain
                and _last_word(p.arg) in _TENSOR_PARAM_WORDS
            ):
                why.setdefault(p.arg, f"{p.arg} is forward's input, named as a tensor")

    def _from_uses(
        self, fn: FunctionNode, returned: bool, why: dict[str, Reason]
    ) -> list[tuple[list[ast.Name], ast.Call]]:
        """Names the function uses as tensors: saved, used with a tensor-only attribute,
        returned by ``forward``, handed first to a torch function, or split beside what is
        saved. Returns the arithmetic handed to torch functions (``torch.round(a / b)``):
        one of its names is a tensor, which one only other evidence can say."""
        ctx = self.ctx
        nodes = list(own_nodes(fn))
        groups: list[tuple[list[ast.Name], ast.Call]] = []
        spread: set[str] = set()  # save_for_backward(*tensors): a list built to be saved
        for call, method in calls_on(nodes, ctx, _SAVES):
            for a in call.args:
                v = a.value if isinstance(a, ast.Starred) else a
                if isinstance(v, ast.Name):
                    why.setdefault(v.id, f"{v.id} is passed to ctx.{method} at L{call.lineno}")
                    if isinstance(a, ast.Starred):
                        spread.add(v.id)
        for n in nodes:
            if isinstance(n, ast.Attribute) and n.attr in TENSOR_USES:
                used = _through_views(n.value)
                if used is not None and used.id not in ctx:
                    why.setdefault(used.id, f"{ast.unparse(n)} at L{n.lineno}")
            elif (
                isinstance(n, ast.Return)
                and n.value is not None
                and returned
                and fn.name == "forward"
            ):
                for r in elements(n.value):
                    if (
                        isinstance(r, ast.Name)
                        and r.id not in ctx
                        and not handle_named(r.id)
                        and r.id not in self.literals
                    ):
                        why.setdefault(r.id, f"forward returns {r.id} at L{n.lineno}")
            if isinstance(n, ast.Call):
                group = self._handed_to_torch(n, why)
                if group:
                    groups.append((group, n))
        for s in self.flow.steps:  # ``tensors, objects = split(...)``: both halves
            if s.split and isinstance(s.node, ast.Assign) and isinstance(s.value, ast.Call):
                halves = {
                    e.id for t in s.node.targets for e in elements(t) if isinstance(e, ast.Name)
                }
                if halves & spread and isinstance(s.target, ast.Name):
                    why.setdefault(
                        s.target.id,
                        f"{s.target.id} is split from {short(s.value)} "
                        f"beside what is saved at L{s.node.lineno}",
                    )
        return groups

    def _handed_to_torch(self, n: ast.Call, why: dict[str, Reason]) -> list[ast.Name]:
        """A name handed first to a torch function (``torch.matmul(a, b)``, ``F.linear(x,
        w)``; later arguments are often sizes, dims or split lists) is a tensor; for
        arithmetic of names handed first, the names, left for the caller to settle."""
        full = resolve(n.func, self.names)
        if not (
            full is not None
            and full.startswith("torch.")
            and not full.startswith(OPAQUE_CALLS)
            and torch_makes_tensor(full)
            and full.rsplit(".", 1)[-1] not in FACTORIES
            and n.args
        ):
            return []
        first = _through_views(n.args[0])
        if first is None:
            return [o for o in _operands(n.args[0]) if o.id not in self.ctx]
        if first.id not in self.ctx:
            why.setdefault(first.id, f"{first.id} is passed to {short(n)} at L{n.lineno}")
        return []

    def _tensor_call(self, call: ast.Call) -> bool:
        """Is ``call`` a torch function or a method (a tensor's, or one of torch's)?"""
        full = resolve(call.func, self.names) or ""
        return full.split(".", 1)[0] == "torch" or (
            isinstance(call.func, ast.Attribute)
            and not (isinstance(call.func.value, ast.Name) and call.func.value.id == "self")
        )

    def _may_hold(self, s: Step) -> bool:
        name = s.name
        if name is None or name in self.ctx or name in self.plain:
            return False
        # p.x = t / p[k] = t into a parameter: the caller's object, not this call's state
        return isinstance(s.target, ast.Name) or name not in self._params

    def _carries(self, s: Step, reached: dict[str, Reason]) -> bool:
        self.tensors = set(reached)
        if (
            s.index is not None
            and isinstance(s.value, ast.Call)
            and self.callee is not None
            and not (resolve(s.value.func, self.names) or "").startswith("torch.")
        ):
            # ``w_fp8, inv_scale = cast_to_fp8(w)``: the callee's own returns say (torch's
            # own functions are judged by name, as everywhere)
            said = self.callee(s.value, self, s.index)
            if said is not None:
                return said
        weak = not s.split or (
            isinstance(s.target, ast.Name) and bool(name_words(s.target.id) & TENSOR_WORDS)
        )
        return self.holds(s.value, weak=weak, excluded=s.not_tensors)

    def explain(self, e: ast.AST) -> str:
        """Why ``e`` holds tensors, in words (see :meth:`_explain`); a helper handed no
        tensor is named for its own body."""
        if (
            isinstance(e, ast.Call)
            and isinstance(e.func, ast.Name)
            and not self.names.get(e.func.id, "").startswith("torch")
            and not any(self.holds(a) for a in [*e.args, *(k.value for k in e.keywords)])
        ):
            return f"{short(e)} returns a tensor, read where {e.func.id} is defined"
        return self._explain(e)

    def _explain(self, e: ast.AST) -> str:
        """Why ``e`` holds tensors, in words: the reason of the first name it holds them
        through, followed one step back (``global_o gets SequenceChunk(...) appended at
        L774; o = torch.matmul(...) at L770``), or what ``e`` is."""
        for n in walk(e):
            if isinstance(n, ast.Name) and n.id in self.why:
                first = self.why[n.id]
                if isinstance(first, Step):
                    for m in walk(first.value):
                        if isinstance(m, ast.Name) and m.id != n.id and m.id in self.why:
                            return f"{first.said()}; {said(self.why[m.id])}"
                return said(first)
        return f"{short(e)} makes a tensor"

    def holds(
        self,
        e: ast.AST,
        local: frozenset[str] = frozenset(),
        weak: bool = True,
        excluded: frozenset[str] = frozenset(),
    ) -> bool:
        """Can ``e`` hold a tensor, on the evidence gathered? With ``weak`` off, a call
        counts only as a ``torch`` function or a tensor method, not as any call handed a
        tensor; ``excluded`` names are known not to hold one here."""

        def h(x: ast.AST, loc: frozenset[str] = local) -> bool:
            return self.holds(x, loc, weak, excluded)

        if isinstance(e, ast.Name):
            return (e.id in self.tensors or e.id in local) and e.id not in excluded
        if isinstance(e, ast.Attribute):
            # x.T, x.grad, storage._data: tensors; any other attribute of a tensor-like
            # object (x._spec, q.layout) is taken as metadata. A field named for tensors
            # of an object a call returned is one (``layer_outputs.buckets``,
            # ``out.threads_masks``)
            if _tensor_attr(e.attr):
                if e.attr in _SAVED and isinstance(e.value, ast.Name) and e.value.id in self.ctx:
                    return True  # ctx.saved_tensors: what save_for_backward kept
                return h(e.value)
            if isinstance(e.value, ast.Name) and e.attr in self.fields.get(e.value.id, ()):
                return e.value.id not in excluded  # a field the class holds a tensor in
            return (
                isinstance(e.value, ast.Name)
                and e.value.id in self.records
                and e.value.id not in excluded
                and _last_word(e.attr) in _TENSOR_FIELD_WORDS
            )
        if isinstance(e, ast.Subscript):
            return h(e.value)
        if isinstance(e, (ast.Starred, ast.NamedExpr, ast.Await)):
            return h(e.value)
        if isinstance(e, ast.BinOp):
            return h(e.left) or h(e.right)
        if isinstance(e, ast.UnaryOp):
            return not isinstance(e.op, ast.Not) and h(e.operand)
        if isinstance(e, ast.BoolOp):
            return any(h(v) for v in e.values)
        if isinstance(e, ast.Compare):
            # ``rand_like(x) > p`` is a boolean tensor; ``x is None`` / ``k in d`` a bool
            return all(isinstance(op, _ELEMENTWISE) for op in e.ops) and any(
                h(v) for v in (e.left, *e.comparators)
            )
        if isinstance(e, ast.IfExp):
            # ``a if not torch.is_tensor(a) else None``: the test says which branch is not
            guard = tensor_test(e.test)
            if guard is not None:
                return h(e.body if guard[0] else e.orelse)
            return h(e.body) or h(e.orelse)
        if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
            return any(h(v) for v in e.elts)
        if isinstance(e, ast.Dict):
            return any(h(v) for v in e.values)
        if isinstance(e, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            inner = set(local)
            for g in e.generators:
                if h(g.iter, frozenset(inner)):
                    inner.update(n.id for n in walk(g.target) if isinstance(n, ast.Name))
            fl = frozenset(inner)
            return h(e.value, fl) if isinstance(e, ast.DictComp) else h(e.elt, fl)
        if isinstance(e, ast.Call):
            return self._call_holds(e, local, weak, excluded)
        return False

    def _call_holds(
        self, e: ast.Call, local: frozenset[str], weak: bool, excluded: frozenset[str]
    ) -> bool:
        func = e.func
        args = [*e.args, *(k.value for k in e.keywords)]
        if isinstance(func, ast.Attribute):
            if func.attr in META_METHODS or func.attr.startswith("__"):
                return False
            if func.attr == "get_rng_state":
                return True
            full = resolve(func, self.names)
            if full is not None and full.split(".", 1)[0] == "torch":
                return torch_makes_tensor(full)
            if self.holds(func.value, local, weak, excluded):
                return True  # a tensor method (or a container's .copy()/.pop())
        elif isinstance(func, ast.Name):
            if func.id in META_BUILTINS:
                return False
            if func.id in CONTAINER_BUILTINS:
                return any(self.holds(a, local, weak, excluded) for a in args)
            full = self.names.get(func.id, func.id)
            if full.startswith("torch."):
                return torch_makes_tensor(full)
        # any other call: its result may keep what it was handed, unless the callee's own
        # body shows it returns none of it (``_resolve_kv_heads(x, ...)`` -> an int); one
        # handed no tensor holds one when its body makes one (fla's ``level_lut(BT, dev)``)
        if not (weak and any(self.holds(a, local, weak, excluded) for a in args)):
            return (
                weak
                and isinstance(func, ast.Name)
                and func.id not in self._bound  # a local lambda, not a helper of that name
                and self.callee is not None
                and self.callee(e, self, None) is True
            )
        return self.callee is None or self.callee(e, self, None) is not False


# --- a tensor of a few numbers ----------------------------------------------------------

#: reductions over every element: a 0-d tensor when called without a dim
_FULL_REDUCTIONS = words(
    "sum mean max min prod norm amax amin all any std var median nansum count_nonzero"
)
#: factories whose first arguments are sizes (``arange`` and friends take a range)
_SIZED = words("zeros ones empty full rand randn randint empty_strided")
_LIKE = words("zeros_like ones_like empty_like full_like rand_like randn_like")
_NEW = words("new_empty new_zeros new_ones new_full")
_CASTS = _SAME_DATA | words("long int bool float double half bfloat16 to clone detach cpu cuda")


def _constant_sizes(args: list[ast.expr]) -> bool:
    return bool(args) and all(
        (isinstance(a, ast.Constant) and isinstance(a.value, int))
        or (isinstance(a, (ast.Tuple, ast.List)) and _constant_sizes(list(a.elts)))
        for a in args
    )


def few(
    e: ast.AST,
    names: dict[str, str],
    bound: Mapping[str, list[ast.AST]],
    seen: frozenset[str] = frozenset(),
) -> bool:
    """Is ``e`` a tensor of a few numbers, whatever the data: a factory with constant
    sizes (``torch.empty(1)``, ``x.new_empty(0)``, ``torch.tensor(2.0)``), a ``*_like``
    of one, a reduction over every element (``x.sum()``, ``torch.sum(x)``), casts and
    copies of those, arithmetic of them with numbers, displays of them, and names
    ``bound`` only to them."""

    def f(x: ast.AST) -> bool:
        return few(x, names, bound, seen)

    if isinstance(e, ast.Name):
        values = bound.get(e.id, ())
        if e.id in seen or not values:
            return False  # ``x = x.contiguous()``: what x was first decides
        inner = seen | {e.id}
        return all(few(v, names, bound, inner) for v in values)
    if isinstance(e, (ast.Tuple, ast.List)):
        return bool(e.elts) and all(f(x) for x in e.elts)
    if isinstance(e, ast.UnaryOp):
        return f(e.operand)
    if isinstance(e, ast.BinOp):
        sides = [e.left, e.right]
        return any(f(x) for x in sides) and all(f(x) or _literal(x) for x in sides)
    if not isinstance(e, ast.Call):
        return False
    dims = any(k.arg in ("dim", "axis") for k in e.keywords)
    full = resolve(e.func, names) or ""
    fn = full.rpartition(".")[2] if full.startswith("torch.") else ""
    if isinstance(e.func, ast.Attribute) and not fn:
        attr = e.func.attr
        if attr in _FULL_REDUCTIONS:
            return not e.args and not dims
        if attr in _NEW:
            return _constant_sizes(e.args[:1])
        return attr in _CASTS and f(e.func.value)
    if fn in _FULL_REDUCTIONS:
        return len(e.args) == 1 and not dims
    if fn in _SIZED:
        return _constant_sizes(list(e.args))
    if fn == "tensor":
        return bool(e.args) and _literal(e.args[0])
    return fn in _LIKE and bool(e.args) and f(e.args[0])
