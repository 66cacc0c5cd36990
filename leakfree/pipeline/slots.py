"""Gradient slots and the non-leaf receive: where a received activation's gradient goes.

:func:`as_nonleaf` turns a receive buffer into a non-leaf alias whose backward hands the
gradient to a :class:`GradSlot` and returns nothing: no accumulation node for the buffer,
no ``.grad`` anywhere, and autograd keeps neither the gradient nor the buffer afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

import leakfree._args as _args
from leakfree.function import Function

__all__ = ["GradSlot", "as_nonleaf"]


class GradSlot:
    """Where the gradient of a received activation goes.

    ``deliver(g)`` (called by autograd through :func:`as_nonleaf`) stores ``g``, or passes it
    to ``callback`` when one is given. ``take()`` returns the stored gradient and forgets
    it. A second gradient before ``take()`` raises ``RuntimeError`` unless
    ``accumulate=True`` (then they are summed, as ``.grad`` would be).

    ``on_delivered`` callbacks (used by :class:`~leakfree.pipeline.RecvBufferPool`) run
    after each delivery.

    Kept: the delivered gradient, by the slot, until ``take()`` (never with ``callback``:
    it is passed on at once); ``callback`` and ``on_delivered``, for the slot's life. The
    slot itself sits on the :func:`as_nonleaf` node's ``ctx`` until that node's backward
    has run (``leakfree.Function`` releases it then) or its graph is dropped.
    """

    __slots__ = ("__weakref__", "_grad", "accumulate", "callback", "deliveries", "on_delivered")
    # It sits on an as_nonleaf ctx and holds gradients, never that node's output: the
    # output-on-ctx walk (leakfree._walk.OPAQUE) need not follow its callbacks.
    __leakfree_opaque__ = True

    def __init__(
        self,
        callback: Callable[[torch.Tensor], None] | None = None,
        *,
        accumulate: bool = False,
    ) -> None:
        _args.function("GradSlot", "callback", callback, none=True)
        _args.flag("GradSlot", "accumulate", accumulate)
        self.callback = callback
        self.accumulate = accumulate
        self._grad: torch.Tensor | None = None
        self.deliveries = 0
        self.on_delivered: list[Callable[[GradSlot], None]] = []

    @property
    def ready(self) -> bool:
        """A gradient is waiting to be taken."""
        return self._grad is not None

    def deliver(self, grad: torch.Tensor) -> None:
        if self.callback is not None:
            self.callback(grad)
        elif self._grad is None:
            self._grad = grad
        elif self.accumulate:
            self._grad = self._grad + grad
        else:
            raise RuntimeError(
                "GradSlot received a second gradient before take(): the activation was "
                "backpropagated twice (retain_graph=True?). take() the first one, or make "
                "the slot with GradSlot(accumulate=True) to sum them."
            )
        self.deliveries += 1
        for fn in self.on_delivered:
            fn(self)

    def take(self) -> torch.Tensor:
        """Return the delivered gradient and forget it."""
        grad = self._grad
        if grad is None:
            raise RuntimeError(
                "GradSlot.take(): no gradient was delivered yet (run the stage's backward "
                "first, or the slot forwards to a callback)"
            )
        self._grad = None
        return grad

    def __repr__(self) -> str:
        state = "callback" if self.callback else ("ready" if self.ready else "empty")
        return f"GradSlot({state}, deliveries={self.deliveries})"


class _ToSlot(Function):
    """Identity on the buffer; its backward hands the gradient to the slot.

    The anchor is a zero-element leaf that requires grad: a custom Function's output
    requires grad only if an input does, and the buffer must not. Backward returns
    nothing for either input, so the anchor never gets a ``.grad`` and no accumulation
    node ever runs. ``ctx.slot`` is released after backward (leakfree.Function).
    """

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, buf: torch.Tensor, slot: GradSlot) -> torch.Tensor:
        ctx.slot = slot
        # An alias, not a view: it shares storage and version counter with the buffer (so
        # autograd still catches an overwrite before backward), and in-place ops on the
        # activation stay allowed.
        return buf.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.slot.deliver(grad)
        return None, None, None


_anchors: dict[torch.device, torch.Tensor] = {}
_anchors_lock = threading.Lock()


def _anchor(device: torch.device) -> torch.Tensor:
    anchor = _anchors.get(device)
    if anchor is None:
        with _anchors_lock:
            anchor = _anchors.setdefault(device, torch.empty(0, device=device, requires_grad=True))
    return anchor


def as_nonleaf(buf: torch.Tensor, slot: GradSlot) -> torch.Tensor:
    """A non-leaf tensor with ``buf``'s data whose gradient goes to ``slot``.

    The result has a ``grad_fn`` and ``is_leaf`` False; it aliases ``buf`` (no copy).
    Its backward calls ``slot.deliver(grad)`` and nothing else: no accumulation node for
    the buffer, no ``.grad``, nothing retained by autograd afterwards.

    Raises ``ValueError`` if ``buf`` requires grad (it would be an autograd leaf itself).
    """
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"as_nonleaf(buf=...): expected a tensor, got {type(buf).__name__}")
    if buf.requires_grad:
        raise ValueError(
            "as_nonleaf(buf=...): the buffer requires grad, so it is (or belongs to) an "
            "autograd graph of its own; receive into a plain buffer (buf.detach() or a "
            "RecvBufferPool buffer)"
        )
    if not isinstance(slot, GradSlot):
        raise TypeError(f"as_nonleaf(slot=...): expected a GradSlot, got {type(slot).__name__}")
    if not (buf.is_floating_point() or buf.is_complex()):
        raise ValueError(
            f"as_nonleaf(buf=...): dtype {buf.dtype} cannot carry a gradient; only "
            "floating point (or complex) activations can be backpropagated"
        )
    if torch.is_grad_enabled():
        out: torch.Tensor = _ToSlot.apply(_anchor(buf.device), buf, slot)
        return out
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "as_nonleaf under torch.inference_mode(): no gradient can flow back, so there is "
            "nothing to deliver; use the received buffer directly"
        )
    with torch.enable_grad():  # under no_grad (evaluation) too: it must be a non-leaf
        out = _ToSlot.apply(_anchor(buf.device), buf, slot)
    return out
