"""Backward boundaries: every ``backward()`` of a training loop, seen without a call in it.

A microbatch ends with a backward pass. ``Tensor.backward`` and every framework's
``backward`` (the Hugging Face Trainer through accelerate, Lightning, the
``torch.distributed.pipelining`` schedules) call ``torch.autograd.backward``; while at least
one listener is registered (a :class:`~leakfree.diagnostics.MemoryTracker` with
microbatches on, ``assert_no_leak``, a callback), that function and
``torch.autograd.grad`` are wrapped so that:

* after each outermost ``torch.autograd.backward`` returns, every listener is called with
  the frame that called it (a backward run inside another, a reentrant checkpoint's, is not
  a boundary);
* a graph backpropagated with ``retain_graph=True`` (by ``backward`` or ``grad``) has its
  nodes marked in their ``metadata`` (:data:`RETAINED`): its saved tensors stay alive, so
  :func:`~leakfree.diagnostics.find_retained` would otherwise not know it already ran.

Lifetime: the wrappers are put in place when the first listener registers and the
originals put back when the last one leaves, unless someone wrapped them again since (then
ours stays, inert, so theirs is not dropped). Listeners are held until their handle's
``remove()``. Not seen: code that calls the engine directly
(``Variable._execution_engine.run_backward``, Megatron's ``custom_backward``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

__all__ = ["RETAINED", "BackwardListener", "on_backward"]

#: ``node.metadata`` key set on the nodes of a graph backpropagated with retain_graph=True
RETAINED = "leakfree.backpropagated"

#: at most this many nodes are marked per retained backward (a guard on huge graphs)
_MAX_MARKED = 100_000

BackwardListener = Callable[[FrameType | None], None]

_listeners: list[BackwardListener] = []
_lock = threading.Lock()
_local = threading.local()
_originals: dict[str, Callable[..., Any]] = {}
_installed: dict[str, Callable[..., Any]] = {}


class _Handle:
    def __init__(self, listener: BackwardListener) -> None:
        self._listener: BackwardListener | None = listener

    def remove(self) -> None:
        """Stop calling the listener (idempotent)."""
        listener, self._listener = self._listener, None
        if listener is None:
            return
        with _lock:
            if listener in _listeners:
                _listeners.remove(listener)
            if not _listeners:
                _uninstall()


def on_backward(listener: BackwardListener) -> _Handle:
    """Call ``listener(frame)`` after every outermost backward pass; returns a handle whose
    ``remove()`` stops it. ``frame`` is the frame that called ``backward`` (None when it
    cannot be told)."""
    if not callable(listener):
        raise TypeError(f"on_backward(listener={listener!r}): expected a callable")
    with _lock:
        _listeners.append(listener)
        _install()
    return _Handle(listener)


def _retains(bound: inspect.BoundArguments) -> bool:
    args = bound.arguments
    retain = args.get("retain_graph")
    return bool(args.get("create_graph", False) if retain is None else retain)


def _mark(roots: Any) -> None:
    """Mark every node reachable from the grad_fns of ``roots`` as backpropagated."""
    tensors = (roots,) if isinstance(roots, torch.Tensor) else tuple(roots or ())
    stack = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor)]
    seen: set[int] = set()
    while stack and len(seen) < _MAX_MARKED:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        with contextlib.suppress(AttributeError, RuntimeError):
            metadata: Any = node.metadata
            metadata[RETAINED] = True
        stack.extend(fn for fn, _ in node.next_functions)


def _wrap(name: str, original: Callable[..., Any], boundary: bool) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _listeners:
            return original(*args, **kwargs)
        depth = getattr(_local, "depth", 0)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # torch's own error, unchanged
        if _retains(bound):
            _mark(bound.arguments.get("tensors", bound.arguments.get("outputs")))
        _local.depth = depth + 1
        try:
            result = original(*args, **kwargs)
        finally:
            _local.depth = depth
        if boundary and depth == 0:
            frame = inspect.currentframe()
            caller = frame.f_back if frame is not None else None
            del frame
            for listener in list(_listeners):
                listener(caller)
            del caller
        return result

    wrapper.__leakfree_boundary__ = name  # type: ignore[attr-defined]
    return wrapper


def _install() -> None:
    for name, boundary in (("backward", True), ("grad", False)):
        current = getattr(torch.autograd, name)
        if getattr(current, "__leakfree_boundary__", None) == name:
            continue
        _originals[name] = current
        _installed[name] = _wrap(name, current, boundary)
        setattr(torch.autograd, name, _installed[name])


def _uninstall() -> None:
    for name, original in list(_originals.items()):
        if getattr(torch.autograd, name) is _installed[name]:
            setattr(torch.autograd, name, original)
            del _originals[name], _installed[name]
        # else: wrapped again by someone since; ours stays in place, inert without listeners
