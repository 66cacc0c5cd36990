"""leakfree.pipeline: non-leaf receive buffers, slots, released outputs, PipelineLosses."""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from leakfree import LossLog
from leakfree.pipeline import (
    GradSlot,
    PipelineLosses,
    PipelineWarning,
    RecvBufferPool,
    as_nonleaf,
    backward_from,
    release_output,
)

# --- non-leaf receive -------------------------------------------------------------------------


def test_as_nonleaf_properties() -> None:
    buf = torch.randn(4, 3)
    slot = GradSlot()
    x = as_nonleaf(buf, slot)
    assert x.grad_fn is not None and not x.is_leaf and x.requires_grad
    assert x.data_ptr() == buf.data_ptr()  # an alias: no copy
    assert not buf.requires_grad and buf.is_leaf
    w = torch.randn(3, 2, requires_grad=True)
    (x @ w).sum().backward()
    expect = torch.ones(4, 2) @ w.detach().T
    assert torch.equal(slot.take(), expect)
    assert buf.grad is None
    anchor = x.grad_fn.next_functions[0][0].variable
    assert anchor.numel() == 0 and anchor.grad is None  # the anchor never accumulates
    # no accumulation node for the buffer anywhere in the graph
    assert all(
        fn is None or getattr(fn, "variable", None) is not buf for fn, _ in x.grad_fn.next_functions
    )


def test_in_place_on_received_activation_allowed_and_versioned() -> None:
    buf = torch.zeros(3)
    x = as_nonleaf(buf, GradSlot())
    x.add_(1.0)  # allowed (an alias, not a custom-Function view)
    assert torch.equal(buf, torch.ones(3))
    w = torch.ones(3, requires_grad=True)
    y = (x * w).sum()  # MulBackward saves x
    buf.fill_(5.0)  # overwriting the buffer before backward: autograd notices
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def _leaf_receive(buf: torch.Tensor) -> torch.Tensor:
    return buf.detach().requires_grad_()  # the usual leaf receive


def test_nothing_retained_after_backward(no_gc: None) -> None:
    """Non-leaf: buffer and gradient free once we drop them. Leaf: .grad pins the gradient."""
    w = torch.randn(64, 64, requires_grad=True)
    # leaf receive: the gradient stays in .grad on the leaf
    buf = torch.randn(32, 64)
    leaf = _leaf_receive(buf)
    (leaf @ w).sum().backward()
    leaf_grad = weakref.ref(leaf.grad)
    del buf
    assert leaf_grad() is not None  # kept until someone clears it
    # non-leaf receive
    buf = torch.randn(32, 64)
    storage = StorageWeakRef(buf.untyped_storage())
    slot = GradSlot()
    x = as_nonleaf(buf, slot)
    out = (x @ w).sum()
    del buf, x
    assert not storage.expired()  # saved by MmBackward for backward: needed
    out.backward()
    g = slot.take()
    grad_ref = weakref.ref(g)
    del g
    assert grad_ref() is None  # autograd kept no reference to the gradient
    # `out` (and so the graph) is alive, but nothing in it holds the buffer any more:
    # MmBackward's saved x was freed by backward, and there is no accumulation node
    assert storage.expired()
    del out


def test_as_nonleaf_bad_input() -> None:
    with pytest.raises(ValueError, match="requires grad"):
        as_nonleaf(torch.randn(2, requires_grad=True), GradSlot())
    with pytest.raises(ValueError, match="cannot carry a gradient"):
        as_nonleaf(torch.ones(2, dtype=torch.int64), GradSlot())
    with pytest.raises(TypeError, match="GradSlot"):
        as_nonleaf(torch.ones(2), object())  # type: ignore[arg-type]


def test_grad_slot_second_gradient_and_accumulate() -> None:
    buf = torch.randn(3)
    slot = GradSlot()
    x = as_nonleaf(buf, slot)
    y = (x * 2).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second gradient before take"):
        y.backward(retain_graph=True)
    assert torch.equal(slot.take(), torch.full((3,), 2.0))
    with pytest.raises(RuntimeError, match="no gradient was delivered"):
        slot.take()
    acc = GradSlot(accumulate=True)
    x = as_nonleaf(buf, acc)
    y = (x * 2).sum()
    y.backward(retain_graph=True)
    y.backward()
    assert torch.equal(acc.take(), torch.full((3,), 4.0))
    seen: list[torch.Tensor] = []
    fwd = GradSlot(seen.append)
    (as_nonleaf(buf, fwd) * 3).sum().backward()
    assert not fwd.ready and torch.equal(seen[0], torch.full((3,), 3.0))


# --- receive buffer pool ----------------------------------------------------------------------


def test_pool_reuses_only_after_delivery() -> None:
    pool = RecvBufferPool()
    w = torch.randn(3, requires_grad=True)
    a = pool.acquire((3,), torch.float32, "cpu")
    b = pool.acquire((3,), torch.float32, "cpu")
    assert a.tensor.data_ptr() != b.tensor.data_ptr()  # a is still needed
    ya = (a.activation * w).sum()
    a.activation = None
    c = pool.acquire((3,), torch.float32, "cpu")
    assert c.tensor.data_ptr() not in (a.tensor.data_ptr(), b.tensor.data_ptr())
    ya.backward()  # a's slot delivers: its buffer returns
    a.slot.take()
    d = pool.acquire((3,), torch.float32, "cpu")
    assert d.tensor is a.tensor
    assert pool.counters.allocated == 3 and pool.counters.reused == 1
    e = pool.acquire((4,), torch.float32, "cpu")  # another shape: another buffer
    assert e.tensor.shape == (4,)


def test_pool_takes_back_buffers_of_dropped_graphs(no_gc: None) -> None:
    pool = RecvBufferPool()
    entry = pool.acquire((8,), torch.float32, "cpu")
    y = (entry.activation * 2).sum()
    entry.activation = None
    buf_ptr = entry.tensor.data_ptr()
    del y, entry  # forward without backward (evaluation, a dropped microbatch)
    assert pool.counters.in_use == 0
    assert pool.acquire((8,), torch.float32, "cpu").tensor.data_ptr() == buf_ptr


# --- sending side -----------------------------------------------------------------------------


def test_release_output_frees_and_backward_from_matches() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16)
    expect = torch.autograd.grad(lin(x).sum(), list(lin.parameters()))
    y = lin(x)  # addmm does not save its output
    storage = StorageWeakRef(y.untyped_storage())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle = release_output(y)
    assert handle.freed and y.numel() == 0
    assert storage.expired()  # the memory is gone; y holds an empty storage
    backward_from(handle, torch.ones(4, 16))
    for p, e in zip(lin.parameters(), expect):
        assert torch.equal(p.grad, e)


@pytest.mark.parametrize("which", ["parameter", "leaf"])
def test_release_output_refuses_leaves_before_touching_them(which: str) -> None:
    lin = nn.Linear(4, 4)
    t = lin.weight if which == "parameter" else torch.randn(3, requires_grad=True)
    before = t.detach().clone()
    what = "a parameter" if which == "parameter" else "a leaf tensor"
    with pytest.raises(ValueError, match=rf"release_output\(y=...\): y is {what} .*not the output"):
        release_output(t)
    assert torch.equal(t.detach(), before)  # not emptied


def test_release_output_twice_is_refused() -> None:
    lin = nn.Linear(16, 16)
    y = lin(torch.randn(4, 16))
    handle = release_output(y)
    with pytest.raises(ValueError, match=r"already released \(it was \(4, 16\), torch.float32\)"):
        release_output(y)
    assert handle.shape == (4, 16)
    backward_from(handle, torch.ones(4, 16))
    assert lin.weight.grad is not None


def test_release_output_refuses_when_storage_is_saved() -> None:
    w = torch.randn(8, requires_grad=True)
    y = torch.sigmoid(w * 2)  # SigmoidBackward saves its output
    with pytest.warns(PipelineWarning, match="still referenced elsewhere"):
        handle = release_output(y)
    assert not handle.freed and y.untyped_storage().nbytes() == 8 * 4
    backward_from(handle, torch.ones(8))
    s = torch.sigmoid(w.detach() * 2)
    assert torch.equal(w.grad, 2 * s * (1 - s))
    v = (w * 3)[:4]
    with pytest.warns(PipelineWarning, match="view"):
        release_output(v)


def test_release_output_never_leaves_a_saved_input_reading_freed_memory() -> None:
    """A later op saved y as an *input* (same TensorImpl: no storage reference to count)."""
    lin = nn.Linear(8, 8)
    y = lin(torch.randn(2, 8))
    aux = (y * y).sum()  # MulBackward saves y itself
    handle = release_output(y)
    assert handle.freed
    assert y.numel() == 0  # a user holding y reads an empty tensor, not freed memory
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        aux.backward()


def test_release_output_with_its_send_alias_keeping_the_shape() -> None:
    """What the torch.distributed.pipelining repair does once a send completed: the output
    and the ``detach()`` the send was posted with (its Work may still hold it) both let go
    of the memory; the output keeps its shape, so torch's own backward(outputs, grads)
    still runs from it, to the same bits."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16)
    expect = torch.autograd.grad(lin(x), list(lin.parameters()), torch.ones(4, 16))
    y = lin(x)
    sent = y.detach()
    storage = StorageWeakRef(y.untyped_storage())
    other = lin(x)
    undeclared = other.detach()
    with pytest.warns(PipelineWarning, match="still referenced elsewhere"):
        release_output(other)  # an alias nobody declared holds it: nothing freed
    assert undeclared.untyped_storage().nbytes() == 4 * 16 * 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle = release_output(y, aliases=[sent], keep_shape=True)
    assert handle.freed and storage.expired()
    assert y.shape == (4, 16) and y.untyped_storage().nbytes() == 4  # one element, stride 0
    assert sent.untyped_storage().nbytes() == 4
    torch.autograd.backward(y, torch.ones(4, 16))
    for p, e in zip(lin.parameters(), expect):
        assert torch.equal(p.grad, e)


def test_release_output_aliases_bad_input() -> None:
    lin = nn.Linear(4, 4)
    y = lin(torch.randn(2, 4))
    with pytest.raises(TypeError, match=r"release_output\(aliases=...\): aliases\[0\] is a list"):
        release_output(y, aliases=[[1.0]])  # type: ignore[list-item]
    assert y.untyped_storage().nbytes() == 2 * 4 * 4  # nothing changed
    other = torch.zeros(2, 4)
    with pytest.warns(PipelineWarning):  # not an alias of y: counted, so y stays held
        handle = release_output(y, aliases=[other])
    assert not handle.freed and other.untyped_storage().nbytes() == 2 * 4 * 4


def test_receive_under_no_grad_and_inference_mode() -> None:
    buf = torch.randn(3)
    with torch.no_grad():  # evaluation: still a non-leaf whose gradient has a place to go
        x = as_nonleaf(buf, GradSlot())
    assert x.grad_fn is not None and not x.is_leaf
    pool = RecvBufferPool()
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="inference_mode"):
            as_nonleaf(buf, GradSlot())
        with pytest.raises(RuntimeError, match="inference_mode"):
            pool.acquire((3,), torch.float32, "cpu")
    assert pool.counters.in_use == 0 and pool.counters.allocated == 0


def test_release_and_backward_bad_input() -> None:
    with pytest.raises(ValueError, match="does not require grad"):
        release_output(torch.ones(3))
    w = torch.randn(3, requires_grad=True)
    handle = release_output(w * 2)
    with pytest.raises(
        ValueError, match=r"gradient \(4,\) torch.float32 on cpu does not match.*\(3,\)"
    ):
        backward_from(handle, torch.ones(4))
    with pytest.raises(TypeError, match="release_output returned"):
        backward_from(w, torch.ones(3))  # type: ignore[arg-type]


# --- PipelineLosses: the losses= container for torch.distributed.pipelining ------------------


class _Park(torch.autograd.Function):
    """Identity that parks a tensor on ctx: only the graph's death frees it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.extra = torch.zeros(256)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


def test_pipeline_losses_detach_on_every_path_and_free_the_graph() -> None:
    made: list[weakref.ref[torch.Tensor]] = []

    def loss() -> torch.Tensor:
        w = torch.randn(3, requires_grad=True)
        y = _Park.apply(w * 2)
        made.append(weakref.ref(y.grad_fn.extra))  # the graph's node owns ctx.extra
        return (y * y).sum()

    plain: list[torch.Tensor] = []
    plain.append(loss())
    assert made[-1]() is not None  # a plain list keeps the graph, and what ctx holds
    sink = PipelineLosses()
    sink.append(loss())
    sink.extend([loss(), loss()])
    sink.insert(0, loss())
    sink += [loss()]
    sink[0] = loss()
    sink[1:2] = [loss()]
    assert len(sink) == 5 and all(t.grad_fn is None and not t.requires_grad for t in sink)
    assert [r() is None for r in made[1:]] == [True] * (len(made) - 1)
    assert made[0]() is not None
    assert type(sink.copy()) is list and isinstance(sink, list)
    assert repr(PipelineLosses()) == "PipelineLosses([])"


def test_pipeline_losses_copy_a_loss_that_pins_a_bigger_storage() -> None:
    per_sample = torch.randn(1000)
    sink = PipelineLosses()
    sink.append(per_sample[3])
    assert sink[0].untyped_storage().nbytes() == 4
    assert sink[0].item() == per_sample[3].item()


@pytest.mark.parametrize("running", [False, True])
def test_pipeline_losses_forward_to_a_log_that_keeps_history(running: bool) -> None:
    log = LossLog(["loss"], running=running)
    sink = PipelineLosses(log)
    for step in range(3):  # what torch's schedule does at each step: clear(), extend()
        sink.clear()
        sink.extend([torch.tensor(float(step)), torch.tensor(float(step) + 1)])
        assert [t.item() for t in sink] == [step, step + 1]  # this step's losses only
    assert log.reduce()["loss"] == pytest.approx((0 + 1 + 1 + 2 + 2 + 3) / 6)
    log["loss"] = [torch.tensor(5.0)]  # a new entry object: the sink follows the log
    sink.append(torch.tensor(7.0))
    assert log.reduce()["loss"] == 6.0


def test_pipeline_losses_bad_input_raises_before_storing() -> None:
    log = LossLog(["loss", "aux"])
    with pytest.raises(ValueError, match=r"key=.*'loss', 'aux'"):
        PipelineLosses(log)
    with pytest.raises(KeyError, match="key='lm'"):
        PipelineLosses(log, "lm")
    with pytest.raises(ValueError, match="needs a log="):
        PipelineLosses(key="loss")
    with pytest.raises(TypeError, match="LossLog, got dict"):
        PipelineLosses({"loss": []})  # type: ignore[arg-type]
    sink = PipelineLosses(log, "aux")
    with pytest.raises(TypeError, match="got float"):
        sink.extend([torch.tensor(1.0), 2.0])
    with pytest.raises(ValueError, match="1-element"):
        sink.extend([torch.tensor(1.0), torch.ones(2)])  # the log refuses: nothing stored
    assert len(sink) == 0 and len(log["aux"]) == 0
