"""leakfree.Function: ctx state released after the last backward, nothing else changed.

Every leak claim is proved both ways: the tensor is alive with plain torch.autograd.Function
and freed with leakfree.Function. Gradients are compared with torch.equal.
"""

from __future__ import annotations

import collections
import functools
import gc
import threading
import time
import types
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from torch.autograd.function import once_differentiable

import leakfree
from leakfree import function as lf_function
from tests._functions import parking

BASES = [torch.autograd.Function, leakfree.Function]


def make_matmul(base: type, *, keep: tuple[str, ...] = ()) -> Any:
    """A matmul that parks a big side object on ctx, as Transformer Engine / Fast-LLM do."""

    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.meta = torch.zeros(256, 256)  # the "big object": 256 KiB
        ctx.cache = torch.ones(8)
        ctx.objects = [_Storage(torch.zeros(64))]  # tensors hidden in objects (TE)
        return x @ w

    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        assert ctx.meta.shape == (256, 256)  # the state is readable during backward
        return g @ w.T, x.T @ g

    namespace = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    if keep:
        namespace["keep"] = keep
    return type("MatMul", (base,), namespace)


def _methods(cls: type) -> dict[str, Any]:
    return {k: v for k, v in cls.__dict__.items() if k in ("forward", "backward")}


class _Storage:
    """Stand-in for a Transformer Engine quantized storage object holding a buffer."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 16, generator=g).requires_grad_()
    w = torch.randn(16, 4, generator=g).requires_grad_()
    return x, w


def refs(node: Any) -> dict[str, weakref.ref[Any]]:
    return {
        "meta": weakref.ref(node.meta),
        "cache": weakref.ref(node.cache),
        "objects": weakref.ref(node.objects[0].data),
    }


def alive(r: dict[str, weakref.ref[Any]]) -> dict[str, bool]:
    return {k: v() is not None for k, v in r.items()}


# --- the leak, both ways ----------------------------------------------------------------------


@pytest.mark.parametrize("base", BASES, ids=["plain", "leakfree"])
def test_ctx_state_after_backward_while_output_alive(base: type, no_gc: None) -> None:
    op = make_matmul(base)
    x, w = inputs()
    y = op.apply(x, w)
    r = refs(y.grad_fn)
    y.sum().backward()
    # y (and so its graph) is still alive, as a logged loss or a kept output would be.
    if base is torch.autograd.Function:
        assert alive(r) == {"meta": True, "cache": True, "objects": True}  # the leak
    else:
        assert alive(r) == {"meta": False, "cache": False, "objects": False}  # fixed
        assert y.grad_fn.__dict__ == {
            lf_function.RELEASED: ("meta", "cache", "objects"),
            **dict.fromkeys(("meta", "cache", "objects")),  # set to None
        }
    del y
    assert alive(r) == {"meta": False, "cache": False, "objects": False}


def test_gradients_bit_identical() -> None:
    results = []
    for base in BASES:
        torch.manual_seed(1)
        x, w = inputs()
        op = make_matmul(base)
        (op.apply(x, w) * torch.arange(4.0)).sum().backward()
        results.append((x.grad, w.grad))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_autograd_managed_state_still_works_after_release() -> None:
    seen = {}

    class Op(leakfree.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x)
            ctx.scale = torch.tensor(2.0)
            ctx.name = "scale"
            return x * w * 2

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, None]:
            seen["needs"] = ctx.needs_input_grad
            (x,) = ctx.saved_tensors
            return g * ctx.scale, None

    x = torch.randn(3, requires_grad=True)
    y = Op.apply(x, torch.tensor(1.0))
    y.sum().backward()
    assert seen["needs"] == (True, False)
    assert y.grad_fn.needs_input_grad == (True, False)
    assert y.grad_fn.metadata == {}
    # Metadata that holds no memory stays; the tensor went.
    assert y.grad_fn.__dict__ == {"name": "scale", "scale": None, lf_function.RELEASED: ("scale",)}
    assert y.grad_fn.scale is None
    with pytest.raises(RuntimeError, match=r"Op a second time.*\(scale\)"):
        y.sum().backward()  # as PyTorch refuses a second pass over freed saved tensors


# --- "last" is exact --------------------------------------------------------------------------


def test_retain_graph_keeps_state_then_second_backward_releases(no_gc: None) -> None:
    op = make_matmul(leakfree.Function)
    plain = make_matmul(torch.autograd.Function)
    x, w = inputs()
    y = op.apply(x, w)
    r = refs(y.grad_fn)
    y.sum().backward(retain_graph=True)
    assert all(alive(r).values())
    first = x.grad.clone()
    x.grad = None
    y.sum().backward()
    assert torch.equal(first, x.grad)
    assert not any(alive(r).values())
    # and the same numbers as plain PyTorch
    xp, wp = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    plain.apply(xp, wp).sum().backward()
    assert torch.equal(xp.grad, x.grad)


def test_create_graph_double_backward(no_gc: None) -> None:
    class Cube(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x)
            ctx.big = torch.randn(1000)
            return x**3

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            return g * 3 * x**2  # differentiable: double backward goes through it

    LfCube = type("Cube", (leakfree.Function,), _methods(Cube))
    out = {}
    for cls in (Cube, LfCube):
        x = torch.tensor([1.0, 2.0, -3.0], requires_grad=True)
        y = cls.apply(x)
        r = weakref.ref(y.grad_fn.big)
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        assert r() is not None  # create_graph keeps the graph, so the state stays
        (gg,) = torch.autograd.grad(g.sum(), x)
        out[cls] = (g.detach(), gg, r, y)
    assert torch.equal(out[Cube][0], out[LfCube][0])
    assert torch.equal(out[Cube][1], out[LfCube][1])
    assert torch.equal(out[LfCube][1], 6 * torch.tensor([1.0, 2.0, -3.0]))
    # the first-order node ran with a kept graph: its state lives until the graph is dropped
    r, y = out[LfCube][2], out[LfCube][3]
    assert r() is not None
    y.sum().backward()  # a final plain backward through it releases it
    assert r() is None


def test_double_backward_through_saved_output_releases_on_the_last_pass(no_gc: None) -> None:
    """exp-like Function: backward uses the saved output, so second order re-enters the node."""

    class Exp(leakfree.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            y = x.exp()
            ctx.save_for_backward(y)
            ctx.extra = torch.randn(100)
            return y

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            (y,) = ctx.saved_tensors
            return g * y

    x = torch.tensor([0.5, 1.0], requires_grad=True)
    y = Exp.apply(x)
    r = weakref.ref(y.grad_fn.extra)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    assert r() is not None
    (gg,) = torch.autograd.grad(g.sum(), x)
    assert torch.equal(gg, x.detach().exp())
    assert r() is None  # the second-order pass went through the node without keeping it


def test_autograd_grad_releases(no_gc: None) -> None:
    op = make_matmul(leakfree.Function)
    x, w = inputs()
    y = op.apply(x, w)
    r = refs(y.grad_fn)
    gx, gw = torch.autograd.grad(y.sum(), (x, w))
    assert not any(alive(r).values())
    plain = make_matmul(torch.autograd.Function)
    px, pw = torch.autograd.grad(plain.apply(x, w).sum(), (x, w))
    assert torch.equal(gx, px)
    assert torch.equal(gw, pw)


def test_explicit_retain_false_with_create_graph_keeps_state(no_gc: None) -> None:
    """create_graph builds a new graph from backward, which may still read ctx: keep it."""
    op = make_matmul(leakfree.Function)
    x, w = inputs()
    y = op.apply(x, w)
    r = refs(y.grad_fn)
    torch.autograd.grad(y.sum(), x, create_graph=True, retain_graph=False)
    assert all(alive(r).values())
    del y
    assert not any(alive(r).values())  # and the graph's death frees it


def test_node_not_reached_keeps_state_until_graph_dropped(no_gc: None) -> None:
    op = make_matmul(leakfree.Function)
    x, w = inputs()
    mid = op.apply(x, w)  # node 1: not reached by the partial backward below
    first = refs(mid.grad_fn)
    w2 = torch.randn(4, 4, requires_grad=True)
    out = op.apply(mid, w2)  # node 2
    second = refs(out.grad_fn)
    torch.autograd.grad(out.sum(), mid)
    assert not any(alive(second).values())
    assert all(alive(first).values())  # not reached: kept, it may still be backpropagated
    del mid, out
    assert not any(alive(first).values())  # graph dropped: freed by refcounting, no cycle


def test_node_hooks_see_what_the_docs_say() -> None:
    """As function.py's docstring and docs/function.md say: pre-hooks and backward see the
    whole state; the release happens when backward returns, before node post-hooks."""
    op = make_matmul(leakfree.Function, keep=("cache",))
    x, w = inputs()
    y = op.apply(x, w)
    seen = []
    y.grad_fn.register_prehook(lambda go: seen.append(("pre", y.grad_fn.meta is not None)))
    y.grad_fn.register_hook(
        lambda gi, go: seen.append(("post", y.grad_fn.meta is not None, y.grad_fn.cache.numel()))
    )
    y.sum().backward()
    assert seen == [("pre", True), ("post", False, 8)]
    doc = " ".join((lf_function.__doc__ or "").split())
    assert "post-hooks (``grad_fn.register_hook``) and everything after see the released" in doc


def test_state_released_node_by_node_during_the_pass(no_gc: None) -> None:
    """Peak memory during backward drops too: each node's state goes as the pass moves on."""
    refs: list[weakref.ref[torch.Tensor]] = []
    alive_when_last_runs = []

    class Layer(leakfree.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, i: int) -> torch.Tensor:
            ctx.i = i
            ctx.buf = torch.zeros(1 << 16)
            refs.append(weakref.ref(ctx.buf))
            return x * 1.0

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
            if ctx.i == 0:  # the first layer's node runs last
                alive_when_last_runs.append(sum(r() is not None for r in refs))
            return g, None

    y = torch.randn(4, requires_grad=True)
    for i in range(16):
        y = Layer.apply(y, i)
    y.sum().backward()
    assert alive_when_last_runs == [1]  # only its own buffer: the other 15 were released
    assert all(r() is None for r in refs)


def test_state_set_in_backward_is_released_too(no_gc: None) -> None:
    box = {}

    class Op(leakfree.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            ctx.scratch = torch.randn(100)
            box["r"] = weakref.ref(ctx.scratch)
            return g * 2

    y = Op.apply(torch.randn(3, requires_grad=True))
    y.sum().backward()
    assert box["r"]() is None


# --- no uncollectable cycle -------------------------------------------------------------------


class _Box:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _Slotted:
    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _stores_output(base: type, how: str) -> Any:
    class StoresOutput(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            out = x * 2
            _stores_output.last = weakref.ref(out.untyped_storage())  # type: ignore[attr-defined]
            if how == "object":  # Transformer Engine's shape: a view inside storage objects
                ctx.out = [_Box(out[:2])]
            elif how == "slots":
                ctx.out = (_Slotted(out),)
            elif how == "set":
                ctx.out = {out}
            elif how == "output":
                ctx.out = out
            elif how == "view":
                ctx.out = out[:2]
            elif how == "container":
                ctx.out = {"pair": [x, out]}
            elif how == "dict-key":
                ctx.out = {out[:2]: "routing"}
            elif how == "deque":
                ctx.out = collections.deque([x, out[1:]])
            elif how == "closure":
                view = out[:2]
                ctx.out = lambda: view
            elif how == "partial-args":
                ctx.out = functools.partial(torch.add, out[:2])
            elif how == "partial-keywords":
                ctx.out = functools.partial(torch.add, other=out[:2])
            elif how == "bound-method":
                ctx.out = _Box(out[:2]).__init__
            elif how == "mapping-proxy":
                ctx.out = types.MappingProxyType({"v": out[:2]})
            elif how == "namedtuple":
                ctx.out = _Pair(x, out[:2])
            elif how == "tensor-attribute":
                holder = x.detach()
                holder.extra = out[:2]
                ctx.out = holder
            elif how == "view-of-view":
                ctx.out = out[1:][:1]
            elif how == "deep":  # deeper than the first version's three levels
                ctx.out = [[[[[_Box(out[:2])]]]]]
            return out

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g * 2

    return StoresOutput


_stores_output.last_output = lambda: _stores_output.last()  # type: ignore[attr-defined]


_HOLDERS = ["output", "view", "container", "object", "slots", "set"]
# Missed by the first version (its walk saw only dict values, lists, tuples, sets and
# objects three levels deep): each of these leaked for good.
_MORE_HOLDERS = [
    "dict-key",
    "deque",
    "closure",
    "partial-args",
    "partial-keywords",
    "bound-method",
    "mapping-proxy",
    "namedtuple",
    "tensor-attribute",
    "view-of-view",
    "deep",
]


class _Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


@pytest.mark.parametrize("how", _HOLDERS + _MORE_HOLDERS)
def test_output_on_ctx_raises_naming_the_attribute(how: str, no_gc: None) -> None:
    op = _stores_output(leakfree.Function, how)
    x = torch.randn(4, requires_grad=True)
    match = r"StoresOutput stored output 0.*ctx\.out"
    with pytest.raises(leakfree.ReferenceCycleError, match=match):
        op.apply(x)
    # the cycle was broken before raising: the output's storage is freed by refcounting
    assert _stores_output.last_output() is None


def test_plain_function_output_view_on_ctx_is_uncollectable(no_gc: None) -> None:
    """Why leakfree refuses it: with plain PyTorch a view of the output on ctx is never freed."""
    op = _stores_output(torch.autograd.Function, "view")
    y = op.apply(torch.randn(4, requires_grad=True))
    r = weakref.ref(y.grad_fn)
    s = weakref.ref(y.untyped_storage())
    del y
    gc.collect()  # even a full collection cannot see the C++ view->base link
    assert r() is not None
    assert s() is not None
    r().__dict__.clear()  # break it by hand so the test process does not keep it
    assert r() is None


@pytest.mark.parametrize("how", ["dict-key", "deque", "closure", "partial-keywords"])
def test_plain_function_output_view_in_any_holder_is_uncollectable(how: str, no_gc: None) -> None:
    """The holders the first version missed leak for good with plain PyTorch too."""
    op = _stores_output(torch.autograd.Function, how)
    y = op.apply(torch.randn(4, requires_grad=True))
    r = weakref.ref(y.grad_fn)
    del y
    gc.collect()
    assert r() is not None
    r().__dict__.clear()
    assert r() is None


def test_output_on_ctx_error_names_the_path(no_gc: None) -> None:
    op = _stores_output(leakfree.Function, "partial-keywords")
    with pytest.raises(leakfree.ReferenceCycleError, match=r"ctx\.out\.keywords\['other'\]"):
        op.apply(torch.randn(4, requires_grad=True))
    op = _stores_output(leakfree.Function, "deep")
    with pytest.raises(leakfree.ReferenceCycleError, match=r"ctx\.out\[0\]\[0\]\[0\]\[0\]\[0\]\.t"):
        op.apply(torch.randn(4, requires_grad=True))


# --- non-differentiable outputs may stay on ctx -----------------------------------------------


def _router(base: type) -> Any:
    """Mixture-of-experts routing: top-k indices (marked non-differentiable) and an argmax
    (an integer output, never differentiable) kept on ctx for backward."""

    class Route(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            vals, idx = x.topk(2, dim=-1)
            best = x.argmax(dim=-1)
            ctx.mark_non_differentiable(idx)
            ctx.idx, ctx.best, ctx.first = idx, best, idx[:, :1]  # a view of one, too
            ctx.routing = {"experts": [idx], best: "argmax"}
            ctx.shape = x.shape
            return vals, idx, best

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor, *_: Any) -> torch.Tensor:
            grad = g.new_zeros(ctx.shape)
            assert torch.equal(ctx.first, ctx.idx[:, :1])
            return grad.scatter_(-1, ctx.idx, g)

    return Route


def test_non_differentiable_outputs_on_ctx_run_as_in_plain_pytorch(no_gc: None) -> None:
    grads, nodes = [], []
    for base in BASES:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).requires_grad_()
        vals, idx, best = _router(base).apply(x)
        assert idx.grad_fn is None and best.grad_fn is None and not best.requires_grad
        nodes.append(weakref.ref(vals.grad_fn))
        (vals * torch.arange(2.0)).sum().backward()
        grads.append(x.grad)
        del vals, idx, best
    assert torch.equal(grads[0], grads[1])
    assert [n() for n in nodes] == [None, None]  # no cycle either way: freed by refcounting


def test_plain_function_output_on_ctx_needs_gc(no_gc: None) -> None:
    op = _stores_output(torch.autograd.Function, "output")
    y = op.apply(torch.randn(4, requires_grad=True))
    r = weakref.ref(y.grad_fn)
    del y
    assert r() is not None  # refcounting alone cannot free it: the cycle
    gc.collect()
    assert r() is None


def test_output_saved_with_save_for_backward_is_fine(no_gc: None) -> None:
    class Good(leakfree.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            out = x.exp()
            ctx.save_for_backward(out)
            ctx.n = out.numel()
            ctx.input = x  # inputs are fine: they do not point back at this node
            return out

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            (out,) = ctx.saved_tensors
            return g * out

    x = torch.randn(4, requires_grad=True)
    y = Good.apply(x)
    r = weakref.ref(y.grad_fn)
    del y
    assert r() is None  # no backward ran, and still no cycle


# --- keep -------------------------------------------------------------------------------------


def test_keep_opts_out_per_attribute(no_gc: None) -> None:
    op = make_matmul(leakfree.Function, keep=("cache",))
    x, w = inputs()
    y = op.apply(x, w)
    r = refs(y.grad_fn)
    y.sum().backward()
    assert alive(r) == {"meta": False, "cache": True, "objects": False}
    assert torch.equal(y.grad_fn.cache, torch.ones(8))
    assert leakfree.released_attributes(op) == "all"


def test_keep_inherited_and_overridden(no_gc: None) -> None:
    base = make_matmul(leakfree.Function, keep=("cache",))
    sub = type("Sub", (base,), {"keep": ("meta",)})
    x, w = inputs()
    y = sub.apply(x, w)
    r = refs(y.grad_fn)
    y.sum().backward()
    assert alive(r) == {"meta": True, "cache": False, "objects": False}
    inherits = type("Inherits", (base,), {})
    y = inherits.apply(x, w)
    r = refs(y.grad_fn)
    y.sum().backward()
    assert alive(r) == {"meta": False, "cache": True, "objects": False}


@pytest.mark.parametrize("keep", ["cache", 3, ("ok", 4), ("not a name",)])
def test_keep_validation(keep: Any) -> None:
    with pytest.raises(TypeError, match=r"\.keep"):
        methods = _methods(make_matmul(torch.autograd.Function))
        type("Bad", (leakfree.Function,), {"keep": keep, **methods})


# --- both styles and the rest of the Function API ---------------------------------------------


def _setup_context_style(base: type, *, with_jvp: bool = True) -> Any:
    class Mul(base):  # type: ignore[misc, valid-type]
        generate_vmap_rule = True

        @staticmethod
        def forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return x * w.sin()

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            x, w = inputs
            ctx.save_for_backward(x, w)
            ctx.save_for_forward(x, w)
            ctx.side = torch.zeros(100)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x, w = ctx.saved_tensors
            return g * w.sin(), g * x * w.cos()

        @staticmethod
        def jvp(ctx: Any, tx: torch.Tensor, tw: torch.Tensor) -> torch.Tensor:
            x, w = ctx.saved_tensors
            assert ctx.side.numel() == 100  # jvp reads ctx right after forward
            return tx * w.sin() + x * w.cos() * tw

    if not with_jvp:  # dynamo refuses custom jvp, for plain Functions too
        names = ("generate_vmap_rule", "forward", "setup_context", "backward")
        return type("Mul", (base,), {k: Mul.__dict__[k] for k in names})
    return Mul


def test_setup_context_style_releases(no_gc: None) -> None:
    op = _setup_context_style(leakfree.Function)
    x, w = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    y = op.apply(x, w)
    r = weakref.ref(y.grad_fn.side)
    y.sum().backward()
    assert r() is None
    plain = _setup_context_style(torch.autograd.Function)
    xp, wp = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    plain.apply(xp, wp).sum().backward()
    assert torch.equal(x.grad, xp.grad)
    assert torch.equal(w.grad, wp.grad)


def test_keyword_arguments_map_like_plain() -> None:
    """``F.apply(x, scale=3.0)``: whatever plain torch does (torch 2.13 maps keywords onto
    forward's parameters; 2.12 refuses them with TypeError), leakfree.Function does too."""
    outcomes = []
    for base in BASES:

        class Scale(base):  # type: ignore[misc, valid-type]
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
                ctx.scale = scale
                return x * scale

            @staticmethod
            def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
                return g * ctx.scale, None

        x = torch.ones(3, requires_grad=True)
        try:
            Scale.apply(x, scale=3.0).sum().backward()
            outcomes.append(x.grad)
        except TypeError as e:
            outcomes.append(str(e))
    plain, ours = outcomes
    if isinstance(plain, str):
        assert ours == plain
    else:
        assert torch.equal(ours, plain) and torch.equal(plain, torch.full((3,), 3.0))


def test_forward_ad_jvp() -> None:
    import torch.autograd.forward_ad as fwAD

    results = []
    for base in BASES:
        op = _setup_context_style(base)
        torch.manual_seed(3)
        x, w = torch.randn(5), torch.randn(5)
        tx, tw = torch.randn(5), torch.randn(5)
        with fwAD.dual_level():
            out = op.apply(fwAD.make_dual(x, tx), fwAD.make_dual(w, tw))
            results.append(fwAD.unpack_dual(out).tangent.clone())
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev", "jacfwd", "vmap_grad"])
def test_torch_func_transforms(transform: str) -> None:
    results = []
    x, w = torch.randn(5), torch.randn(5)
    for base in BASES:
        op = _setup_context_style(base)

        def f(x: torch.Tensor, w: torch.Tensor, op: Any = op) -> torch.Tensor:
            return op.apply(x, w).sum()

        if transform == "grad":
            res = torch.func.grad(f, argnums=(0, 1))(x, w)
        elif transform == "vjp":
            _, fn = torch.func.vjp(lambda x, w, op=op: op.apply(x, w), x, w)
            res = fn(torch.ones(5))
        elif transform == "jacrev":
            res = torch.func.jacrev(lambda x, w, op=op: op.apply(x, w), argnums=(0, 1))(x, w)
        elif transform == "jacfwd":
            res = torch.func.jacfwd(lambda x, w, op=op: op.apply(x, w), argnums=(0, 1))(x, w)
        else:
            res = (torch.func.vmap(torch.func.grad(f))(x.expand(3, 5), w.expand(3, 5)),)
        results.append(res)
    for a, b in zip(results[0], results[1]):
        assert torch.equal(a, b)


def test_vmap_staticmethod() -> None:
    calls = []

    def make(base: type) -> Any:
        class Twice(base):  # type: ignore[misc, valid-type]
            @staticmethod
            def forward(x: torch.Tensor) -> torch.Tensor:
                return x * 2

            @staticmethod
            def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
                ctx.note = "twice"

            @staticmethod
            def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
                return g * 2

            @staticmethod
            def vmap(info: Any, in_dims: Any, x: torch.Tensor) -> tuple[torch.Tensor, int]:
                calls.append(base)
                return Twice.apply(x.movedim(in_dims[0], 0)), 0

        return Twice

    outs = [torch.func.vmap(make(b).apply)(torch.arange(6.0).view(2, 3)) for b in BASES]
    assert calls == BASES
    assert torch.equal(outs[0], outs[1])


def test_once_differentiable_mark_dirty_non_differentiable_materialize(no_gc: None) -> None:
    seen: list[Any] = []

    def make(base: type) -> Any:
        class Fancy(base):  # type: ignore[misc, valid-type]
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor, buf: torch.Tensor) -> Any:
                ctx.set_materialize_grads(False)
                ctx.save_for_backward(x)
                ctx.big = torch.randn(100)
                buf.mul_(2)
                ctx.mark_dirty(buf)
                idx = x.argmax().unsqueeze(0)
                ctx.mark_non_differentiable(idx)
                return x * 3, buf, idx

            @staticmethod
            @once_differentiable
            def backward(ctx: Any, g: Any, gbuf: Any, gidx: Any) -> Any:
                seen.append((g is None, gbuf is None))
                (x,) = ctx.saved_tensors
                return (None if g is None else g * 3), (None if gbuf is None else gbuf * 2)

        return Fancy

    grads = []
    for base in BASES:
        x = torch.randn(4, requires_grad=True)
        b0 = torch.randn(4, requires_grad=True)
        buf = b0.clone()
        y, buf2, idx = make(base).apply(x, buf)
        assert buf2 is buf and not idx.requires_grad
        r = weakref.ref(y.grad_fn.big)
        y.sum().backward()  # buf's gradient is not materialized: None arrives
        grads.append((x.grad.clone(), b0.grad))
        if base is leakfree.Function:
            assert r() is None
    assert seen == [(False, True), (False, True)]
    assert torch.equal(grads[0][0], grads[1][0])
    assert grads[0][1] is None and grads[1][1] is None


def test_vjp_defined_instead_of_backward(no_gc: None) -> None:
    class ViaVjp(leakfree.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.big = torch.randn(100)
            return x * 5

        @staticmethod
        def vjp(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g * 5

    x = torch.randn(3, requires_grad=True)
    y = ViaVjp.apply(x)
    r = weakref.ref(y.grad_fn.big)
    y.sum().backward()
    assert r() is None
    assert torch.equal(x.grad, torch.full((3,), 5.0))


def test_saved_tensors_hooks(no_gc: None) -> None:
    packed: list[list[int]] = [[], []]
    results = []
    for i, base in enumerate(BASES):
        op = make_matmul(base)
        x, w = inputs()

        def pack(t: torch.Tensor, i: int = i) -> torch.Tensor:
            packed[i].append(t.numel())
            return t.clone()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = op.apply(x, w)
        r = weakref.ref(y.grad_fn.meta)
        y.sum().backward()
        results.append((x.grad, w.grad))
        assert (r() is None) == (base is leakfree.Function)
    assert packed[0] == packed[1] == [128, 64]
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_inside_activation_checkpointing(use_reentrant: bool, no_gc: None) -> None:
    results = []
    for base in BASES:
        op = make_matmul(base)
        x, w = inputs()
        metas: list[weakref.ref[torch.Tensor]] = []

        def run(x: torch.Tensor, w: torch.Tensor, op: Any = op, metas: Any = metas) -> Any:
            out = op.apply(x, w)
            if out.grad_fn is not None and type(out.grad_fn) is op._backward_cls:
                metas.append(weakref.ref(out.grad_fn.meta))
            return out

        y = torch.utils.checkpoint.checkpoint(run, x, w, use_reentrant=use_reentrant)
        loss = (y * 2).sum()
        loss.backward(retain_graph=True)
        loss.backward()  # recomputed forward, twice: each recomputation is a fresh node
        assert metas  # the recomputed nodes were seen
        if base is leakfree.Function:
            assert all(r() is None for r in metas)
        results.append((x.grad, w.grad))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


# --- torch.compile ----------------------------------------------------------------------------


def _graph_breaks(fn: Any, *args: Any) -> int:
    torch._dynamo.reset()
    return int(torch._dynamo.explain(fn)(*args).graph_break_count)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("style", ["forward_ctx", "setup_context"])
def test_torch_compile(backend: str, style: str) -> None:
    results, breaks = [], []
    for base in BASES:
        op = (
            make_matmul(base)
            if style == "forward_ctx"
            else _setup_context_style(base, with_jvp=False)
        )
        if style == "forward_ctx":
            x, w = inputs()
        else:
            torch.manual_seed(3)
            x, w = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)

        def f(x: torch.Tensor, w: torch.Tensor, op: Any = op) -> torch.Tensor:
            return (op.apply(x, w) * 2).sum()

        breaks.append(_graph_breaks(f, x, w))
        torch._dynamo.reset()
        compiled = torch.compile(f, backend=backend, fullgraph=True)
        compiled(x, w).backward()
        results.append((x.grad, w.grad))
    torch._dynamo.reset()
    assert breaks[0] == breaks[1] == 0
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_torch_compile_graph_break_count_matches_plain() -> None:
    """A Function that forces a graph break costs the same number of breaks on both bases."""
    counts = []
    for base in BASES:

        class Printy(base):  # type: ignore[misc, valid-type]
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                ctx.n = int(x.sum().item() > 0)  # data-dependent: a graph break
                return x * 2

            @staticmethod
            def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
                return g * 2

        def f(x: torch.Tensor, op: Any = Printy) -> torch.Tensor:
            return op.apply(x * 3).sum()

        counts.append(_graph_breaks(f, torch.randn(4, requires_grad=True)))
    torch._dynamo.reset()
    assert counts[0] == counts[1]


# --- threads ----------------------------------------------------------------------------------


def test_two_threads_backward_separate_graphs() -> None:
    """One thread retains its graph, the other does not, concurrently: each gets its own answer."""
    op = make_matmul(leakfree.Function)
    plain = make_matmul(torch.autograd.Function)
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def worker(retain: bool) -> None:
        try:
            for _ in range(200):
                x, w = inputs()
                y = op.apply(x, w)
                r = weakref.ref(y.grad_fn.meta)
                barrier.wait(timeout=30)
                y.sum().backward(retain_graph=retain)
                if retain:
                    assert r() is not None, "state released under retain_graph=True"
                    y.sum().backward()
                assert r() is None, "state not released after the last backward"
                expect_x, expect_w = torch.autograd.grad(plain.apply(x, w).sum(), (x, w))
                assert torch.equal(x.grad, expect_x * 2 if retain else expect_x)
                assert torch.equal(w.grad, expect_w * 2 if retain else expect_w)
        except BaseException as e:  # reported in the main thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(flag,)) for flag in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def _shared_node_op(base: type, arrived: threading.Barrier | None) -> Any:
    """A node that saved nothing (so plain PyTorch allows any number of backward calls
    through it) and keeps a tensor on ctx, which backward reads."""

    class Scale(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.scale = torch.tensor(3.0)
            return x * 3.0

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            if arrived is not None:
                arrived.wait(timeout=30)  # every thread is inside this backward now
                if threading.current_thread().name != "first":
                    time.sleep(0.05)  # ...and "first" returns before the others read ctx
            return g * ctx.scale

    return Scale


def _run_threads(n: int, target: Callable[[], None]) -> list[BaseException]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as e:  # reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, name="first" if i == 0 else f"t{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return errors


@pytest.mark.parametrize("base", BASES, ids=["plain", "leakfree"])
def test_concurrent_backward_through_a_shared_node_sees_the_whole_ctx(
    base: type, no_gc: None
) -> None:
    """Backward calls that overlap in time all see the state; it goes when the last returns."""
    n = 4
    op = _shared_node_op(base, threading.Barrier(n))
    x = torch.ones(3, requires_grad=True)
    y = op.apply(x)
    scale = weakref.ref(y.grad_fn.scale)
    errors = _run_threads(n, lambda: torch.autograd.grad(y.sum(), x))
    assert not errors, errors
    if base is leakfree.Function:
        assert scale() is None  # released once, after the last of the four returned
        assert y.grad_fn.__dict__ == {"scale": None, lf_function.RELEASED: ("scale",)}
        assert not lf_function._running and not lf_function._due
    else:
        assert scale() is not None


def test_concurrent_backward_release_is_atomic(no_gc: None) -> None:
    """No barrier: 8 threads race through one node, 50 times. A call that starts after the
    release gets leakfree's second-backward error; nothing else ever escapes (the first
    version raised KeyError in its own release, or AttributeError in the user's backward)."""
    op = _shared_node_op(leakfree.Function, None)
    for _ in range(50):
        x = torch.ones(3, requires_grad=True)
        y = op.apply(x)
        results: list[Any] = []

        def backward(y: torch.Tensor = y, x: torch.Tensor = x, out: list[Any] = results) -> None:
            out.append(torch.autograd.grad(y.sum(), x)[0])

        errors = _run_threads(8, backward)
        assert all(isinstance(e, RuntimeError) and "a second time" in str(e) for e in errors), (
            errors
        )
        assert len(results) + len(errors) == 8 and results
        assert all(torch.equal(r, torch.full((3,), 3.0)) for r in results)
        assert y.grad_fn.__dict__ == {"scale": None, lf_function.RELEASED: ("scale",)}
    assert not lf_function._running and not lf_function._due


def test_backward_that_raises_does_not_pin_the_node(no_gc: None) -> None:
    """An exception in the user's backward leaves no record behind, and the state stays
    (that pass did not finish, so the node was not used up)."""

    class Fails(leakfree.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.buf = torch.zeros(4)
            return x * 1.0

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom")

    y = Fails.apply(torch.ones(2, requires_grad=True))
    with pytest.raises(ValueError, match="boom"):
        y.sum().backward()
    assert "buf" in y.grad_fn.__dict__
    assert not lf_function._running and not lf_function._due


# --- release_after_backward -------------------------------------------------------------------


def _third_party() -> Any:
    """A Function someone else wrote, parking state on ctx (class created fresh per test)."""
    return make_matmul(torch.autograd.Function)


def test_release_after_backward_covers_graphs_built_before(no_gc: None) -> None:
    op = _third_party()
    x, w = inputs()
    y = op.apply(x, w)  # built before the patch
    r = refs(y.grad_fn)
    with leakfree.release_after_backward(op):
        y.sum().backward()
        assert not any(alive(r).values())
    y = op.apply(x, w)
    r = refs(y.grad_fn)
    y.sum().backward()  # restored: the leak is back
    assert all(alive(r).values())


def test_release_after_backward_named_attrs(no_gc: None) -> None:
    op = _third_party()
    handle = leakfree.release_after_backward(op, attrs=("meta", "objects"))
    assert handle.attrs == ("meta", "objects")
    x, w = inputs()
    y = op.apply(x, w)
    r = refs(y.grad_fn)
    y.sum().backward()
    assert alive(r) == {"meta": False, "cache": True, "objects": False}
    assert y.grad_fn.meta is None  # set to None, as upstream fixes do
    handle.restore()


@pytest.mark.parametrize("attrs", ["all", ("meta", "cache", "objects")])
def test_all_and_named_attrs_release_the_same_way(attrs: Any) -> None:
    """``attrs`` says *which* attributes go, never *how*: in both cases they are set to
    None and a second backward is refused, naming them (before, "all" deleted them and
    named ones were set to None with no marker, so a second backward ran on Nones)."""
    op = _third_party()
    with leakfree.release_after_backward(op, attrs=attrs) as handle:
        assert handle.attrs == ("all" if attrs == "all" else tuple(sorted(attrs)))
        assert leakfree.released_attributes(op) == handle.attrs
        x, w = inputs()
        y = op.apply(x, w)
        y.sum().backward()
        state = {n: y.grad_fn.__dict__[n] for n in ("meta", "cache", "objects")}
        assert state == dict.fromkeys(state)
        with pytest.raises(RuntimeError, match=r"a second time.*\((meta|cache|objects), "):
            y.sum().backward()


def test_release_after_backward_idempotent_and_exact_restore() -> None:
    op = _third_party()
    original = op.__dict__["backward"]
    h1 = leakfree.release_after_backward(op)
    h2 = leakfree.release_after_backward(op)
    assert h1 is h2
    wrapped = op.__dict__["backward"]
    assert getattr(wrapped.__func__, lf_function._ORIGINAL) is original
    h3 = leakfree.release_after_backward(op, attrs=("meta",))  # new spec replaces, wraps once
    assert getattr(op.__dict__["backward"].__func__, lf_function._ORIGINAL) is original
    assert not h1.active and h3.active
    assert leakfree.released_attributes(op) == ("meta",)
    h3.restore()
    h3.restore()
    assert op.__dict__["backward"] is original
    assert leakfree.released_attributes(op) == ()
    assert "restored" in repr(h3)


def test_release_after_backward_inherited_backward_restores_to_absent() -> None:
    parent = _third_party()
    child = type("Child", (parent,), {})
    assert "backward" not in child.__dict__
    handle = leakfree.release_after_backward(child)
    assert "backward" in child.__dict__
    assert not hasattr(parent.__dict__["backward"].__func__, lf_function._ORIGINAL)
    handle.restore()
    assert "backward" not in child.__dict__


def test_release_after_backward_bad_input() -> None:
    with pytest.raises(TypeError, match="torch.autograd.Function subclass"):
        leakfree.release_after_backward(torch.nn.Linear)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="torch.autograd.Function subclass"):
        leakfree.release_after_backward(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"attrs=\('meta',\)"):
        leakfree.release_after_backward(_third_party(), attrs="meta")
    with pytest.raises(TypeError, match=r"attrs=None.*attrs=\"all\""):
        leakfree.release_after_backward(_third_party(), attrs=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not attribute names"):
        leakfree.release_after_backward(_third_party(), attrs=("a b",))

    class NoBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(TypeError, match="neither backward nor vjp"):
        leakfree.release_after_backward(NoBackward)
    assert "backward" not in NoBackward.__dict__  # nothing changed
    lf_op = make_matmul(leakfree.Function)
    with pytest.raises(TypeError, match=r"already releases.*keep"):
        leakfree.release_after_backward(lf_op)
    assert leakfree.released_attributes(lf_op) == "all"  # untouched


def test_release_after_backward_thread_safe_install() -> None:
    op = _third_party()
    handles: list[Any] = []
    threads = [
        threading.Thread(target=lambda: handles.append(leakfree.release_after_backward(op)))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(h) for h in handles}) == 1
    handles[0].restore()
    assert not hasattr(op.__dict__["backward"].__func__, lf_function._ORIGINAL)


# --- fallbacks when the engine's private API is missing ---------------------------------------


def test_fallback_without_keep_graph_flag(monkeypatch: pytest.MonkeyPatch, no_gc: None) -> None:
    monkeypatch.setattr(lf_function, "_keep_graph", None)
    op = make_matmul(leakfree.Function)  # created under the fallback
    x, w = inputs()
    y = op.apply(x, w)
    r = refs(y.grad_fn)
    y.sum().backward(retain_graph=True)
    assert all(alive(r).values())  # saved tensors still there: kept
    y.sum().backward()
    assert not any(alive(r).values())  # saved tensors freed by the pass: released


def test_fallback_without_current_node(monkeypatch: pytest.MonkeyPatch, no_gc: None) -> None:
    monkeypatch.setattr(lf_function, "_current_node", None)
    op = make_matmul(leakfree.Function)
    x, w = inputs()
    y = op.apply(x, w)
    r = refs(y.grad_fn)
    y.sum().backward(retain_graph=True)
    assert all(alive(r).values())
    y.sum().backward()
    assert not any(alive(r).values())


def test_fallback_without_keep_flag_handles_nodes_that_saved_nothing(
    monkeypatch: pytest.MonkeyPatch, no_gc: None
) -> None:
    monkeypatch.setattr(lf_function, "_keep_graph", None)

    y = parking(leakfree.Function).apply(torch.randn(3, requires_grad=True))  # nothing saved
    r = weakref.ref(y.grad_fn.big)
    y.sum().backward(retain_graph=True)
    assert r() is not None  # the engine marks even an empty saved list as released, or not
    y.sum().backward()
    assert r() is None


def test_compiled_autograd_gradients_match() -> None:
    """Under compiled autograd the wrapper is traced (is_compiling) and calls straight through."""
    from torch._dynamo import compiled_autograd

    results = []
    for base in BASES:
        op = make_matmul(base)
        x, w = inputs()
        torch._dynamo.reset()
        with compiled_autograd._enable(torch.compile(backend="eager")):
            (op.apply(x, w) * 2).sum().backward()
        results.append((x.grad, w.grad))
    torch._dynamo.reset()
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


# --- regressions from review: dispatch, delegation, classmethods, second backward -------------


def _grad_reverse(base: type, alpha: Any) -> Any:
    class GradReverse(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.alpha = alpha
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return -ctx.alpha * g

    return GradReverse


def _forward_with_metadata(ctx: Any, x: torch.Tensor) -> torch.Tensor:
    ctx.alpha = 0.5
    ctx.dtype, ctx.device, ctx.shape, ctx.dims = x.dtype, x.device, x.shape, (0, 1)
    ctx.mode, ctx.flag, ctx.nothing = "reverse", True, None
    return x.view_as(x)


def test_second_backward_reading_only_metadata_runs_as_in_plain_pytorch() -> None:
    """Metadata (numbers, strings, dtypes, shapes, tuples of them) holds no memory, so it
    stays: a node that saved nothing can be backwarded twice, as plain PyTorch allows."""
    grads = []
    for base in BASES:
        op = _grad_reverse(base, 0.5)
        op.forward = staticmethod(_forward_with_metadata)  # type: ignore[method-assign]
        x = torch.ones(3, requires_grad=True)
        y = op.apply(x)
        y.sum().backward()
        y.sum().backward()  # no retain_graph: the node saved no tensors
        assert lf_function.RELEASED not in y.grad_fn.__dict__
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
    assert torch.equal(grads[1], torch.full((3,), -1.0))


def test_second_backward_after_tensor_state_was_released_is_a_clear_error() -> None:
    """A node that saved nothing but kept a tensor on ctx: PyTorch would allow a second
    backward; leakfree released the tensor, and says so instead of a bare AttributeError."""
    op = _grad_reverse(leakfree.Function, torch.tensor(0.5))
    x = torch.ones(3, requires_grad=True)
    y = op.apply(x)
    y.sum().backward()
    with pytest.raises(RuntimeError, match=r"GradReverse a second time.*\(alpha\).*retain_graph"):
        y.sum().backward()
    y = op.apply(x)  # the documented way: retain every pass but the last
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), -1.5))


def _classmethod_family(base: type) -> Any:
    class Parent(base):  # type: ignore[misc, valid-type]
        factor = 2.0

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.big = torch.zeros(100)
            return x * 1.0

        @classmethod
        def backward(cls, ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g * cls.factor

    class Child(Parent):
        factor = 10.0

    return Parent, Child


def test_classmethod_backward_sees_the_subclass(no_gc: None) -> None:
    for base in BASES:
        _, child = _classmethod_family(base)
        x = torch.ones(2, requires_grad=True)
        y = child.apply(x)
        r = weakref.ref(y.grad_fn.big)
        y.sum().backward()
        assert torch.equal(x.grad, torch.full((2,), 10.0))
        assert (r() is None) == (base is leakfree.Function)
    parent, child = _classmethod_family(torch.autograd.Function)
    with leakfree.release_after_backward(parent):
        x = torch.ones(2, requires_grad=True)
        y = child.apply(x)
        r = weakref.ref(y.grad_fn.big)
        y.sum().backward()
        assert torch.equal(x.grad, torch.full((2,), 10.0))
        assert r() is None
    assert isinstance(parent.__dict__["backward"], classmethod)
    assert not hasattr(parent.__dict__["backward"].__func__, lf_function._ORIGINAL)


def test_delegating_backward_uses_the_dispatched_class_keep(no_gc: None) -> None:
    class A(leakfree.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.cache = torch.ones(3)
            ctx.big = torch.zeros(100)
            return x * 2

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g * 2

    class B(A):
        keep = ("cache",)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return A.backward(ctx, g)  # A's wrapper must not release with A's keep

    y = B.apply(torch.randn(3, requires_grad=True))
    r = weakref.ref(y.grad_fn.big)
    y.sum().backward()
    assert "cache" in y.grad_fn.__dict__
    assert r() is None
    assert y.grad_fn.__dict__[lf_function.RELEASED] == ("big",)


def test_backward_called_by_hand_inside_another_pass_does_not_release() -> None:
    op = make_matmul(leakfree.Function)
    x, w = inputs()
    y = op.apply(x, w)
    z = torch.randn(3, requires_grad=True)
    z.register_hook(lambda g: (y.grad_fn.apply(torch.ones(8, 4)), g)[1])  # a probe
    (z * 1).sum().backward()
    assert y.grad_fn.meta is not None  # the engine never ran y's node
    y.sum().backward()
    assert y.grad_fn.meta is None


def test_create_graph_with_retain_false_keeps_state_for_the_new_graph() -> None:
    """The graph built by a create_graph backward may read the first-order ctx."""

    class CubeBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, g: torch.Tensor, x: torch.Tensor, fctx: Any) -> torch.Tensor:
            ctx.fctx = fctx
            ctx.save_for_backward(g, x)
            return g * 3 * x**2

        @staticmethod
        def backward(ctx: Any, gg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
            g, x = ctx.saved_tensors
            s = ctx.fctx.scale  # reads the first-order ctx during double backward
            return gg * 3 * x**2, gg * 6 * x * g * s, None

    class Cube(leakfree.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x)
            ctx.scale = 1.0
            return x**3

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            return CubeBackward.apply(g, x, ctx)

    x = torch.tensor([1.0, 2.0], requires_grad=True)
    (g,) = torch.autograd.grad(Cube.apply(x).sum(), x, create_graph=True, retain_graph=False)
    (gg,) = torch.autograd.grad(g.sum(), x)
    assert torch.equal(gg, torch.tensor([6.0, 12.0]))


def test_third_party_keep_attribute_is_not_ours() -> None:
    op = _third_party()
    op.keep = 42  # an unrelated class attribute that happens to be called `keep`
    with leakfree.release_after_backward(op):
        x, w = inputs()
        y = op.apply(x, w)
        y.sum().backward()
        assert y.grad_fn.meta is None


def test_released_attributes_follows_the_backward_autograd_runs() -> None:
    parent = _third_party()
    child_override = type("Child", (parent,), {"backward": staticmethod(lambda ctx, g: (g, g))})
    child_inherits = type("Child2", (parent,), {})
    with leakfree.release_after_backward(parent, attrs=("meta",)):
        assert leakfree.released_attributes(parent) == ("meta",)
        assert leakfree.released_attributes(child_inherits) == ("meta",)
        assert leakfree.released_attributes(child_override) == ()
    assert leakfree.released_attributes(parent) == ()
    assert leakfree.released_attributes(torch.nn.Linear) == ()


def test_apply_is_found_on_every_torch() -> None:
    """torch 2.14 moved ``Function.apply`` into C (``_FunctionBase``, a
    ``classmethod_descriptor``): ``Function.apply.__func__``, which 2.13 allowed, no longer
    exists, and ``import leakfree`` failed there. Both shapes, each with a subclass passing
    itself."""
    from leakfree.function import _class_method

    class Py:
        @classmethod
        def make(cls, x: int) -> tuple[type, int]:
            return cls, x

    class PySub(Py):
        pass

    class CSub(dict):  # type: ignore[type-arg]
        pass

    assert _class_method(PySub, "make")(PySub, 3) == (PySub, 3)
    made = _class_method(CSub, "fromkeys")(CSub, ["a"])  # dict.fromkeys: written in C
    assert type(made) is CSub and made == {"a": None}


def test_restore_leaves_a_wrapper_installed_on_top_of_ours() -> None:
    """A profiler (or another patcher) wraps backward after leakfree did: restore() must
    not drop it. It warns, keeps both, and restores once the outer wrapper is gone."""

    class Outer(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.kept = x * 2
            return x.clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g

    original = Outer.__dict__["backward"]
    handle = leakfree.release_after_backward(Outer)
    ours = Outer.__dict__["backward"]
    calls: list[int] = []
    inner = ours.__func__

    def profiled(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return inner(ctx, g)

    Outer.backward = staticmethod(profiled)  # type: ignore[method-assign]
    with pytest.warns(leakfree.LeakfreeWarning, match="wrapped again after leakfree"):
        assert handle.restore() is False
    assert Outer.__dict__["backward"].__func__ is profiled and handle.active
    x = torch.randn(3, requires_grad=True)
    y = Outer.apply(x)
    y.sum().backward()
    assert calls == [1] and torch.equal(x.grad, torch.ones(3))  # the outer one still runs
    Outer.backward = ours  # type: ignore[method-assign]  # the profiler undoes itself
    assert handle.restore() is True and Outer.__dict__["backward"] is original
