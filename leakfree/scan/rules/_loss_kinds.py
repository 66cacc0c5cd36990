"""What LF003 takes a value for: a loss, a forward result, clean, or unknown.

The vocabulary (names spelled like losses, loss functions, graph-keeping and detaching
methods, log-like containers) and :class:`Kinds`, the expression judge the statement walker
in :mod:`~leakfree.scan.rules.kept_losses` inherits. Unknown is never flagged.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from enum import Enum

from leakfree.scan._syntax import FunctionNode, name_words, tail

CODE = "LF003"


class Kind(Enum):
    LOSS = "loss"
    FORWARD = "forward result"
    CLEAN = "clean"


#: ``loss``, ``losses``, ``total_loss``, ``aux_losses``
LOSS_NAME = re.compile(r"^(?:\w+_)?loss(?:es)?$", re.IGNORECASE)
FORWARD_NAME = re.compile(r"^(?:\w+_)?(?:logits|outputs?)$", re.IGNORECASE)
#: callees that return a loss
LOSS_CALLEE = re.compile(
    r"^(?:\w+_)?(?:criterion|loss_fn|loss_func|lossfn|loss_function|loss)$"
    r"|^(?:compute|calc|calculate|get)_\w*loss(?:es)?$",
    re.IGNORECASE,
)
#: ``torch.nn.functional`` losses (those ending in ``_loss`` match by name too)
TORCH_LOSSES = frozenset(
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
MODEL_CALLEE = re.compile(r"^(?:\w+_)?(?:model|module|net|network|forward)$", re.IGNORECASE)
#: methods that keep the graph of their receiver
KEEP = frozenset(
    {
        "mean", "sum", "float", "double", "half", "bfloat16", "to", "cpu", "cuda", "view",
        "view_as", "reshape", "clone", "squeeze", "unsqueeze", "contiguous", "flatten",
        "expand", "expand_as", "mul", "add", "sub", "div", "pow", "sqrt", "abs", "exp", "log",
        "neg", "clamp", "nan_to_num", "masked_fill", "norm", "type_as", "nanmean", "nansum",
        "prod", "max", "min", "sigmoid", "softmax", "log_softmax", "squeeze_", "t",
    }
)  # fmt: skip
#: methods and attributes whose result has no graph
DETACH = frozenset({"detach", "item", "tolist", "numpy", "data", "detach_tree"})
METADATA = frozenset(
    {
        "shape", "dtype", "device", "ndim", "requires_grad", "is_leaf", "grad_fn", "grad",
        "layout", "names", "is_cuda", "size", "dim", "numel", "nelement", "element_size",
        "get_device", "is_contiguous", "data_ptr", "stride", "storage_offset", "is_floating_point",
        "isnan", "isinf", "isfinite", "eq", "ne", "gt", "lt", "ge", "le", "argmax", "argmin",
        "long", "int", "bool", "any", "all", "keys",
    }
)  # fmt: skip
CLEAN_BUILTINS = frozenset(
    {"float", "int", "bool", "len", "str", "repr", "round", "format", "isinstance", "id", "hash"}
)
JOIN_BUILTINS = frozenset({"sum", "max", "min", "abs", "list", "tuple"})
TORCH_MODULES = frozenset({"torch", "F", "functional", "nn"})
#: torch.* functions that never return a graph
TORCH_CLEAN = frozenset(
    {"is_tensor", "is_floating_point", "numel", "typename", "isnan", "isinf", "isfinite",
     "equal", "allclose", "argmax", "argmin", "no_grad", "zeros_like", "ones_like", "empty_like",
     "tensor", "as_tensor", "full_like"}
)  # fmt: skip
#: words of a container name that read like a log kept across steps
LOG_WORDS = frozenset(
    {
        "loss", "losses", "metric", "metrics", "log", "logs", "logged", "history", "histories",
        "stats", "statistics", "record", "records", "tracker", "summary", "summaries",
        "scalars", "running",
    }
)  # fmt: skip
#: parameter names of per-step context / state objects
CONTEXT_PARAMS = frozenset(
    {"context", "batch_context", "step_context", "run_context", "state", "train_state"}
)
SINK_METHODS = frozenset({"append", "extend", "insert", "add", "appendleft"})
NO_GRAD_STEPS = re.compile(
    r"^(?:validation_step|test_step|predict_step|prediction_step|evaluate\w*|eval_\w*|"
    r"_?eval_step|\w*_eval)$"
    # and any step named for evaluation or inference (NeMo's ``pair_evaluation_step``,
    # ``inference_step``, ``_validation_step_internal``), which Lightning's and most
    # loops' validation calls with grad off
    r"|^\w*?(?:^|_)(?:validation|evaluation|inference|prediction|predict|test)_step(?:_\w*)?$"
)
#: words naming a container that collects evaluation outputs (Lightning's
#: ``validation_step_outputs``, ``test_step_outputs``): filled with grad off
EVAL_WORDS = frozenset(
    {"validation", "val", "test", "eval", "evaluation", "inference", "predict", "prediction"}
)
#: classes that prepare data, never run with grad (``GPTQADataset.features``)
DATA_CLASSES = re.compile(r"(?:Dataset|DataModule|Sampler|Collator|Tokenizer|DataLoader)$")
NO_GRAD_CTX = frozenset({"no_grad", "inference_mode"})
BACKWARD_CALLS = frozenset(
    {"backward", "grad", "stage_backward", "manual_backward", "run_backward"}
)
LOSSLOG_TYPES = frozenset({"LossLog", "LossList", "RunningLoss"})
#: calls never followed as storing helpers
NOT_HELPERS = SINK_METHODS | {"update", "backward", "forward", "print", "super"}


def is_lookup(value: ast.expr) -> bool:
    """``kwargs.get("partial_losses")``: a dict lookup says nothing about what it holds."""
    return isinstance(value, ast.Call) and tail(value.func) in {"get", "pop", "setdefault"}


def join(kinds: Iterable[Kind | None]) -> Kind | None:
    seen = list(kinds)
    if Kind.LOSS in seen:
        return Kind.LOSS
    if Kind.FORWARD in seen:
        return Kind.FORWARD
    if seen and all(k is Kind.CLEAN for k in seen):
        return Kind.CLEAN
    return None


def name_kind(name: str) -> Kind | None:
    name = name.rstrip("_")
    if name.isupper():
        return None  # a constant or an enum member (Kind.LOSS), never a tensor
    if LOSS_NAME.match(name):
        return Kind.LOSS
    if FORWARD_NAME.match(name):
        return Kind.FORWARD
    return None


def is_no_grad_with(item: ast.withitem) -> bool:
    expr = item.context_expr
    if isinstance(expr, ast.Call):
        expr = expr.func
    return tail(expr) in NO_GRAD_CTX


def is_no_grad_decorated(func: FunctionNode) -> bool:
    for dec in func.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if tail(target) in NO_GRAD_CTX:
            return True
    return False


def log_like(names: Iterable[str]) -> bool:
    """Does any of the names read like a log kept across steps (``losses``, ``history``)?"""
    return any(name_words(n) & LOG_WORDS for n in names)


#: words of containers that loggers fill with detached values (``tracker["values"]``)
_LOGGED_WORDS = frozenset(
    {"tracker", "history", "histories", "metric", "metrics", "log", "logs", "logged",
     "stats", "statistics", "record", "records", "summary", "summaries", "scalars"}
)  # fmt: skip


def read_from_log(e: ast.Subscript) -> bool:
    """An entry read out of a logger's container: what loggers keep is detached (where one
    keeps a graph, the finding is at the store, not at the read)."""
    names = [tail(e.value)]
    base = e.value
    while isinstance(base, (ast.Attribute, ast.Subscript)):
        base = base.value
        names.append(tail(base))
    return any(name_words(n) & _LOGGED_WORDS for n in names if n)


class Kinds:
    """The kind of an expression, given what the function knows of its locals
    (``env.kinds``), its instance's name (``self_name``) and, for a call of a function
    defined where it can be read, that function's own verdict (``helper_kind``)."""

    #: local name -> its kind, as the statements so far left it
    known: dict[str, Kind | None]
    self_name: str | None
    #: names the module binds to its functions and classes (no graph in them)
    definitions: frozenset[str] = frozenset()
    #: names bound to imported modules (an attribute of one, not called, is a function)
    modules: frozenset[str] = frozenset()

    def helper_kind(self, call: ast.Call) -> Kind | bool | None:
        """The kind ``call``'s callee returns, read from its definition; False when no
        definition could be read (the callee's name decides then)."""
        return False

    def kind(self, e: ast.expr) -> Kind | None:
        if isinstance(e, ast.Name):
            if e.id in self.known:
                return self.known[e.id]
            if e.id == self.self_name:
                return None
            if e.id in self.definitions:
                return Kind.CLEAN  # a function or class, however it is named
            return name_kind(e.id)
        if isinstance(e, ast.Constant | ast.JoinedStr | ast.Compare | ast.Lambda):
            return Kind.CLEAN
        if isinstance(e, ast.Attribute):
            if e.attr in DETACH or e.attr in METADATA:
                return Kind.CLEAN
            if isinstance(e.value, ast.Name) and e.value.id in self.modules:
                return Kind.CLEAN  # ``ltorch.nll_loss`` handed on: the function itself
            if isinstance(e.value, ast.Name) and e.value.id == self.self_name:
                # self.loss / self.losses is as often a loss module or a container of
                # floats as a tensor: the attribute's name alone decides nothing
                return None
            base = self.kind(e.value)
            if base is Kind.CLEAN:
                return Kind.CLEAN
            if LOSS_NAME.match(e.attr) and not e.attr.isupper():
                return Kind.LOSS
            if base is not None:
                return base
            return Kind.FORWARD if FORWARD_NAME.match(e.attr) and e.attr != "output" else None
        if isinstance(e, ast.Subscript):
            if read_from_log(e):
                return Kind.CLEAN
            base = self.kind(e.value)
            if base is not None:
                return base
            key = e.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                return Kind.LOSS if LOSS_NAME.match(key.value) else None
            return None
        if isinstance(e, ast.BinOp):
            return join([self.kind(e.left), self.kind(e.right)])
        if isinstance(e, ast.UnaryOp):
            return Kind.CLEAN if isinstance(e.op, ast.Not) else self.kind(e.operand)
        if isinstance(e, ast.BoolOp):
            return Kind.CLEAN
        if isinstance(e, ast.IfExp):
            return join([self.kind(e.body), self.kind(e.orelse)])
        if isinstance(e, ast.List | ast.Tuple | ast.Set):
            # an empty container is unknown: what is appended to it later decides
            return join(self.kind(x) for x in e.elts) if e.elts else None
        if isinstance(e, ast.Dict):
            return join(self.kind(v) for v in e.values if v is not None) if e.values else None
        if isinstance(e, ast.Await):
            return self.kind(e.value)
        if isinstance(e, ast.Call):
            return self.call_kind(e)
        return None

    def call_kind(self, e: ast.Call) -> Kind | None:
        func = e.func
        name = tail(func)
        if name in DETACH or name in METADATA:
            return Kind.CLEAN
        if name[:1].isupper():
            # a class: ``nn.ModuleDict(...)``, ``CrossEntropyLoss()`` build objects, not
            # loss values; one built around a loss (``Output(loss=loss)``) holds it
            held = join(self.kind(a) for a in (*e.args, *(k.value for k in e.keywords)))
            return held if held in (Kind.LOSS, Kind.FORWARD) else Kind.CLEAN
        if isinstance(func, ast.Name):
            if name in CLEAN_BUILTINS:
                return Kind.CLEAN
            if name in JOIN_BUILTINS:
                return join(self.kind(a) for a in e.args) if e.args else None
            if name == self.self_name and name != "cls":
                return Kind.FORWARD  # self(x): a module calling its own forward
        if isinstance(func, ast.Attribute):
            base = func.value
            if (isinstance(base, ast.Name) and base.id in TORCH_MODULES) or (
                isinstance(base, ast.Attribute) and base.attr in {"functional", "nn"}
            ):
                if name in TORCH_LOSSES or LOSS_NAME.match(name):
                    return Kind.LOSS
                if name in TORCH_CLEAN:
                    return Kind.CLEAN
                return join(self.kind(a) for a in e.args) if e.args else None
            receiver = self.kind(base)
            if receiver is Kind.CLEAN:
                return Kind.CLEAN
            if receiver is not None and name in KEEP:
                return receiver
        named_loss = LOSS_CALLEE.match(name) or (LOSS_NAME.match(name) and name != "losses")
        if named_loss or MODEL_CALLEE.match(name):
            read = self.helper_kind(e)  # the helper's own body decides over its name
            if read is not False:
                return read  # type: ignore[return-value]
        if named_loss:
            return Kind.LOSS
        if MODEL_CALLEE.match(name):
            return Kind.FORWARD
        return None
