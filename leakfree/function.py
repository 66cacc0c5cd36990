"""Release a custom autograd Function's ``ctx`` state after the last backward that can use it.

Autograd frees the tensors a node saved with ``ctx.save_for_backward`` once the node's
backward has run (unless the graph is retained), but it never touches plain attributes on
``ctx``: ``ctx.meta = big_object`` lives for as long as the backward node does, which is as
long as anything still references the graph (a logged loss, an output kept for the next
step...). Transformer Engine's ``ctx.tensor_objects`` and Fast-LLM's ``ctx.context`` leaked
tens of GB this way.

This module holds the one mechanism leakfree uses to fix that, and two ways to apply it:

* :class:`Function`, a drop-in base class for :class:`torch.autograd.Function`;
* :func:`release_after_backward`, which applies the same release to a Function class
  someone else wrote (the Transformer Engine patch is built on it).

Lifetime contract
-----------------
*Released*: the attributes that ``forward`` / ``setup_context`` (or ``backward`` itself)
set on ``ctx``, right after the last backward through the node, i.e. at the end of the
first backward pass whose graph task does not keep the graph (a plain ``backward()`` or
``torch.autograd.grad()``; not ``retain_graph=True`` nor ``create_graph=True``). The
release is queued to run when that backward pass finishes, so hooks registered on the
node still see the state during the pass.

*Kept*: everything autograd manages itself (``saved_tensors``, ``needs_input_grad``,
``materialize_grads``, ``metadata``...), attributes named in the class's ``keep``, and all
state of nodes that a backward never reached: those live until the graph is dropped, as
in plain PyTorch, and then everything is freed together.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch.autograd.function import BackwardCFunction

__all__ = [
    "Function",
    "ReferenceCycleError",
    "ReleaseHandle",
    "release_after_backward",
    "released_attributes",
]

# --- engine feature detection ---------------------------------------------------------
# Both are private but long-standing (AOTAutograd relies on the first). Without them we
# degrade to a conservative, still-correct behaviour rather than guessing.

#: Inside a backward pass: does the running graph task keep the graph (retain/create_graph)?
#: Outside the engine it returns True.
_keep_graph: Callable[[], bool] | None = getattr(
    torch._C._autograd, "_get_current_graph_task_keep_graph", None
)
_queue_callback: Callable[[Callable[[], None]], None] | None = getattr(
    torch.autograd.Variable._execution_engine, "queue_callback", None
)
_graph_task_id: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)

_is_compiling = torch.compiler.is_compiling

#: The attribute that marks a backward installed by this module, pointing at the user's.
_ORIGINAL = "__leakfree_original__"
#: Per-class record of what release_after_backward installed (kept in the class __dict__).
_HANDLE = "__leakfree_release__"

_lock = threading.RLock()


class ReferenceCycleError(RuntimeError):
    """A Function stored one of its own outputs (or a view of one) on ``ctx``.

    The output's ``grad_fn`` *is* ``ctx``, so output -> ctx -> output is a reference cycle.
    A graph whose backward never runs is then freed only by the cyclic garbage collector,
    and never when the attribute is a view of the output (the view's base link lives in
    C++, invisible to the collector) or when ``gc`` is disabled or frozen.
    """


# --- the mechanism ----------------------------------------------------------------------


def _node_ctx(ctx: Any) -> BackwardCFunction | None:
    """The backward node that really holds the user's attributes, or None.

    ``torch.func`` hands backward a wrapper whose attribute writes go to the node it wraps
    (``_pt_inner_ctx``); compiled autograd hands it a proxy we must not touch.
    """
    while not isinstance(ctx, BackwardCFunction):
        inner = getattr(ctx, "__dict__", {}).get("_pt_inner_ctx")
        if inner is None:
            return None
        ctx = inner
    return ctx


def _release(ctx: BackwardCFunction, names: frozenset[str] | None, keep: frozenset[str]) -> None:
    state = ctx.__dict__
    if names is None:
        if keep:
            for name in [n for n in state if n not in keep]:
                del state[name]
        else:
            state.clear()
    else:
        # Named attributes (third-party classes) are set to None, exactly as upstream fixes
        # do, so library code that tests `ctx.attr is None` keeps working.
        for name in names:
            if name in state:
                state[name] = None


def _release_if_saved_freed(
    ctx: BackwardCFunction, names: frozenset[str] | None, keep: frozenset[str]
) -> None:
    # Fallback when the engine cannot tell us whether the graph is kept: the engine has
    # just finished the pass; if it freed this node's saved tensors, the node is done.
    try:
        ctx._raw_saved_tensors  # noqa: B018  (raises once the saved tensors were released)
    except RuntimeError:
        _release(ctx, names, keep)


def _after_backward(ctx: Any, names: frozenset[str] | None, keep: frozenset[str]) -> None:
    """Schedule the release of ``ctx`` state if this backward is the last one through it."""
    node = ctx if isinstance(ctx, BackwardCFunction) else _node_ctx(ctx)
    if node is None:
        return
    if _keep_graph is not None and _queue_callback is not None:
        # The common path. Outside the engine _keep_graph() is True, so we never queue there.
        if not _keep_graph():
            # Runs when this backward pass ends: node post-hooks can still read ctx meanwhile.
            _queue_callback(functools.partial(_release, node, names, keep))
        return
    _after_backward_fallback(node, names, keep)


def _after_backward_fallback(
    node: BackwardCFunction, names: frozenset[str] | None, keep: frozenset[str]
) -> None:
    if _keep_graph is not None:  # no queue_callback: release now (post-hooks see it gone)
        if not _keep_graph():
            _release(node, names, keep)
        return
    # No keep-graph flag: let the end of the pass tell us whether saved tensors were freed.
    in_engine = _graph_task_id is None or _graph_task_id() != -1
    if _queue_callback is not None and in_engine:
        _queue_callback(functools.partial(_release_if_saved_freed, node, names, keep))


def _make_backward(
    user_fn: Callable[..., Any], names: frozenset[str] | None, keep: frozenset[str]
) -> Callable[..., Any]:
    fast = _keep_graph is not None and _queue_callback is not None
    keep_graph, queue, partial, release = _keep_graph, _queue_callback, functools.partial, _release

    @functools.wraps(user_fn)
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        if _is_compiling():
            # Traced by dynamo / compiled autograd: AOTAutograd owns lifetimes there, and
            # the engine calls below are not traceable.
            return user_fn(ctx, *grad_outputs)
        grads = user_fn(ctx, *grad_outputs)
        if fast and isinstance(ctx, BackwardCFunction):
            # The common path, inlined (this runs once per node per backward). Outside the
            # engine keep_graph() is True, so nothing is queued there.
            if not keep_graph():  # type: ignore[misc]
                # Runs when this backward pass ends: node post-hooks can still read ctx.
                queue(partial(release, ctx, names, keep))  # type: ignore[misc]
        else:
            _after_backward(ctx, names, keep)
        return grads

    setattr(backward, _ORIGINAL, user_fn)
    return backward


def _backward_name(cls: type) -> str | None:
    """Which of ``backward`` / ``vjp`` the class implements (autograd calls that one)."""
    if getattr(cls, "vjp", None) is not torch.autograd.Function.vjp:
        return "vjp"
    if getattr(cls, "backward", None) is not torch.autograd.Function.backward:
        return "backward"
    return None


class ReleaseHandle:
    """What :func:`release_after_backward` installed on one class; ``restore()`` undoes it.

    Also a context manager: ``with release_after_backward(Cls): ...`` restores on exit.
    """

    def __init__(
        self,
        cls: type[torch.autograd.Function],
        method: str,
        raw_original: Any,
        names: frozenset[str] | None,
        keep: frozenset[str],
    ) -> None:
        self.cls = cls
        self.method = method
        self._raw_original = raw_original  # the class __dict__ entry, or None if inherited
        self.names = names
        self.keep = keep

    @property
    def attrs(self) -> tuple[str, ...] | None:
        """The released attribute names, or None for "all ctx state" (minus ``keep``)."""
        return None if self.names is None else tuple(sorted(self.names))

    @property
    def active(self) -> bool:
        return self.cls.__dict__.get(_HANDLE) is self

    def restore(self) -> None:
        """Put back the exact original ``backward`` / ``vjp``. Idempotent."""
        with _lock:
            if not self.active:
                return
            if self._raw_original is None:
                delattr(self.cls, self.method)
            else:
                setattr(self.cls, self.method, self._raw_original)
            delattr(self.cls, _HANDLE)

    def __enter__(self) -> ReleaseHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def __repr__(self) -> str:
        what = "all ctx state" if self.names is None else ", ".join(sorted(self.names))
        state = "active" if self.active else "restored"
        return f"<ReleaseHandle {self.cls.__qualname__}.{self.method}: {what} ({state})>"


def _install(
    cls: type[torch.autograd.Function], names: frozenset[str] | None, keep: frozenset[str]
) -> ReleaseHandle | None:
    with _lock:
        current: ReleaseHandle | None = cls.__dict__.get(_HANDLE)
        if current is not None:
            if current.names == names and current.keep == keep:
                return current  # idempotent
            current.restore()  # re-install from the original with the new spec
        method = _backward_name(cls)
        if method is None:
            return None
        user_fn = getattr(cls, method)
        # An inherited backward may already be one of ours: wrap what the user wrote.
        user_fn = getattr(user_fn, _ORIGINAL, user_fn)
        handle = ReleaseHandle(cls, method, cls.__dict__.get(method), names, keep)
        setattr(cls, method, staticmethod(_make_backward(user_fn, names, keep)))
        setattr(cls, _HANDLE, handle)
        return handle


def release_after_backward(
    cls: type[torch.autograd.Function], attrs: Iterable[str] | None = None
) -> ReleaseHandle:
    """Release ``ctx`` state of an existing Function class after its last backward.

    Wraps the class's ``backward`` (or ``vjp``) in place. Autograd looks ``backward`` up on
    the class at backward time, so graphs built *before* this call are covered too.

    Args:
        cls: a :class:`torch.autograd.Function` subclass, typically one you do not own.
        attrs: ``None`` releases every attribute forward / ``setup_context`` / backward set
            on ``ctx`` (they are deleted). A collection of names releases only those (each is
            set to ``None``, as upstream fixes such as Transformer Engine 2.15's do).

    Returns:
        A :class:`ReleaseHandle`; ``handle.restore()`` puts the original method back. Calling
        again with the same ``attrs`` returns the same handle; with other ``attrs`` the new
        choice replaces the old one (the original is still what ``restore()`` puts back).

    Subclasses that inherit the patched method inherit the release. ``keep`` on a
    :class:`leakfree.Function` subclass is honoured when ``attrs`` is None.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        raise TypeError(
            "release_after_backward(cls): cls must be a torch.autograd.Function subclass, "
            f"got {cls!r}. For a Function you write yourself, subclass leakfree.Function."
        )
    names: frozenset[str] | None
    if attrs is None:
        names = None
    elif isinstance(attrs, str):
        raise TypeError(
            f"release_after_backward(attrs={attrs!r}): attrs must be a collection of names, "
            f"not one string; write attrs=({attrs!r},)"
        )
    else:
        names = frozenset(attrs)
        bad = [a for a in names if not (isinstance(a, str) and a.isidentifier())]
        if bad:
            raise TypeError(f"release_after_backward(attrs=...): not attribute names: {bad!r}")
    keep = _keep_of(cls) if names is None else frozenset()
    handle = _install(cls, names, keep)
    if handle is None:
        raise TypeError(
            f"release_after_backward({cls.__qualname__}): the class defines neither backward "
            "nor vjp, so there is no backward after which to release its ctx state."
        )
    return handle


def released_attributes(cls: type) -> tuple[str, ...] | None:
    """What a class releases after backward: ``None`` for all ctx state, names, or ``()``
    when nothing is installed."""
    handle = cls.__dict__.get(_HANDLE) if isinstance(cls, type) else None
    if handle is None:
        # Inherited installation (subclass of a patched class).
        for base in getattr(cls, "__mro__", ())[1:]:
            handle = base.__dict__.get(_HANDLE)
            if handle is not None:
                break
    if handle is None:
        return ()
    attrs: tuple[str, ...] | None = handle.attrs
    return attrs


# --- the base class -----------------------------------------------------------------------


def _keep_of(cls: type) -> frozenset[str]:
    keep = getattr(cls, "keep", ())
    if isinstance(keep, str):
        raise TypeError(
            f"{cls.__qualname__}.keep must be a tuple of ctx attribute names, not one string; "
            f"write keep = ({keep!r},)"
        )
    if not isinstance(keep, (tuple, list, set, frozenset)) or not all(
        isinstance(k, str) and k.isidentifier() for k in keep
    ):
        raise TypeError(
            f"{cls.__qualname__}.keep must be a tuple of ctx attribute names, got {keep!r}"
        )
    return frozenset(keep)


def _refers_to(value: Any, outputs: tuple[Any, ...], depth: int = 0) -> int | None:
    """Index of the output that ``value`` is (or is a view of), looking into containers."""
    if isinstance(value, torch.Tensor):
        base = value._base
        for i, out in enumerate(outputs):
            if value is out or (base is not None and base is out):
                return i
        return None
    if depth < 2:
        if isinstance(value, (list, tuple)):
            items: Iterable[Any] = value
        elif isinstance(value, dict):
            items = value.values()
        else:
            return None
        for item in items:
            hit = _refers_to(item, outputs, depth + 1)
            if hit is not None:
                return hit
    return None


def _check_no_output_on_ctx(cls: type, result: Any) -> None:
    # Hot path (every apply): one grad_fn lookup and, usually, a ctx.__dict__ without tensors.
    outputs = result if type(result) is tuple else (result,)
    node = None
    for out in outputs:
        if isinstance(out, torch.Tensor):
            node = out.grad_fn
            if node is not None:
                break
    if node is None or type(node) is not cls._backward_cls:  # type: ignore[attr-defined]
        return  # no output requires grad: no graph, no cycle
    state = node.__dict__
    if not state:
        return
    for name, value in state.items():
        if not isinstance(value, _MAY_HOLD_TENSORS):
            continue
        index = _refers_to(value, outputs)
        if index is not None:
            state.clear()  # break the cycle before reporting it
            raise ReferenceCycleError(
                f"{cls.__qualname__} stored output {index} (or a view of it) on ctx.{name}. "
                "That output's grad_fn is this ctx, so output -> ctx -> output is a "
                "reference cycle that outlives the graph (for a view, even gc cannot free "
                "it). Save it with ctx.save_for_backward(...) and read it from "
                "ctx.saved_tensors in backward: autograd saves outputs without the cycle."
            )


_MAY_HOLD_TENSORS = (torch.Tensor, list, tuple, dict)
_function_apply = torch.autograd.Function.apply.__func__  # type: ignore[attr-defined]


class Function(torch.autograd.Function):
    """Drop-in for :class:`torch.autograd.Function` whose ``ctx`` state cannot outlive its use.

    Write forward / setup_context / backward / jvp / vmap exactly as for
    ``torch.autograd.Function``. On top of PyTorch's behaviour:

    * **Released after the last backward**: every attribute set on ``ctx`` (by forward,
      setup_context, jvp or backward), once a backward pass that does not keep the graph has
      run through the node. ``backward(retain_graph=True)`` and ``create_graph=True`` keep
      it for the next pass. Reading a released attribute raises ``AttributeError``.
    * **Kept**: autograd-managed state (``saved_tensors``, ``needs_input_grad``, ...);
      attributes listed in the class attribute ``keep`` (``keep = ("cache",)``), which then
      live as long as the node, as in plain PyTorch; and all state of a node that no
      backward reached, until the graph is dropped.
    * **Refused**: storing an output (or a view of one) on ``ctx``: :class:`ReferenceCycleError`
      is raised when ``apply`` returns, naming the attribute. Use ``ctx.save_for_backward``.

    Gradients are bit-identical to the same class on ``torch.autograd.Function``; under
    ``torch.compile`` the class traces exactly as a plain Function would (no metaclass, no
    forward wrapper).
    """

    #: Names of ctx attributes that are *not* released after backward.
    keep: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _install(cls, None, _keep_of(cls))

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        result = _function_apply(cls, *args, **kwargs)
        _check_no_output_on_ctx(cls, result)
        return result
