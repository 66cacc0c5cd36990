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
*Released*: the attributes that ``forward`` / ``setup_context`` / ``jvp`` (or ``backward``
itself) set on ``ctx``, at the node's last backward: the first backward pass through it
whose graph task does not keep the graph (a plain ``backward()`` or
``torch.autograd.grad()``; not ``retain_graph=True`` nor ``create_graph=True``). The
release happens right after the node's backward returns, inside the pass, so each node's
state goes as the pass moves on. What the node's hooks see follows from that: pre-hooks
and ``backward`` see the whole state; node post-hooks (``grad_fn.register_hook``) and
everything after see the released node. When several threads run backward through the
same node at once, the release waits for the last of them to return, and happens once.

*Kept*: everything autograd manages itself (``saved_tensors``, ``needs_input_grad``,
``materialize_grads``, ``metadata``...); attributes named in the class's ``keep``;
metadata that holds no memory (numbers, strings, ``None``, dtypes, devices, shapes, enum
members and tuples of these), so a backward that reads only such values can run again, as
in plain PyTorch; and all state of nodes that a backward never reached: those live until
the graph is dropped, as in plain PyTorch, and then everything is freed together.

*After the release*, another backward through the node raises a ``RuntimeError`` that
names the released attributes, where plain PyTorch would let a node that saved no tensors
run again: retain the graph in every pass but the last, or list the attributes in ``keep``.
"""

from __future__ import annotations

import functools
import threading
import types
import warnings
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Literal

import torch
from torch.autograd.function import BackwardCFunction

from leakfree._nodes import RELEASED, backward_ran
from leakfree._walk import (
    METADATA_TYPES,
    OPAQUE,
    SCALAR_TYPES,
    holds_no_memory,
    is_scalar,
    search,
)
from leakfree.errors import LeakfreeWarning

__all__ = [
    "Function",
    "ReferenceCycleError",
    "ReleaseHandle",
    "release_after_backward",
    "released_attributes",
]
# The node-lifecycle core (used by every wrapper here, by the Transformer Engine patches
# through release_after_backward, and by diagnostics.retention): is_last_backward,
# backward_ran, release. Module-level, not exported.

# --- engine feature detection ---------------------------------------------------------
# All private but long-standing (AOTAutograd relies on the first). Without them we degrade
# to a conservative, still-correct behaviour rather than guessing.

#: Inside a backward pass: does the running graph task keep the graph (retain/create_graph)?
#: Outside the engine it returns True.
_keep_graph: Callable[[], bool] | None = getattr(
    torch._C._autograd, "_get_current_graph_task_keep_graph", None
)
#: The node the engine is executing right now (None outside backward).
_current_node: Callable[[], Any] | None = getattr(torch._C, "_current_autograd_node", None)
_queue_callback: Callable[[Callable[[], None]], None] | None = getattr(
    torch.autograd.Variable._execution_engine, "queue_callback", None
)

_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled

#: Set on the function object of every backward installed by this module: the raw class
#: attribute it replaced (a staticmethod, classmethod or plain function).
_ORIGINAL = "__leakfree_original__"
#: Per-class record of what is installed (kept in the class __dict__).
HANDLE = "__leakfree_release__"

_lock = threading.RLock()


class ReferenceCycleError(RuntimeError):
    """A Function stored one of its own outputs (or a view of one) on ``ctx``.

    The output's ``grad_fn`` *is* ``ctx``, so output -> ctx -> output is a reference cycle.
    A graph whose backward never runs is then freed only by the cyclic garbage collector,
    and never when the attribute is a view of the output (the view's base link lives in
    C++, invisible to the collector) or when ``gc`` is disabled or frozen.
    """


# --- the mechanism ----------------------------------------------------------------------
# Several threads may run backward through one node at once (they share part of a graph);
# plain PyTorch lets them, so a release must never happen under a call that is still
# reading ctx, and must happen once. The protocol costs the common path no lock:
#
# * a call registers in `_running` (a list append, atomic) *before* it looks at ctx, and
#   unregisters when its backward returns;
# * a release runs under `_state_lock`: it marks the node due, publishes `RELEASED` in
#   ctx.__dict__, *then* looks in `_running`; if a call is registered, it withdraws the
#   marker and leaves the node due for that call to release when it returns;
# * a call that finds `RELEASED` on entry takes the lock, so it sees the release decided.
#
# Whichever of "register" and "publish" comes first, the other side sees it: either the
# release withdraws, or the call sees a released node. Python's atomic list and dict
# operations make each step indivisible.

_state_lock = threading.Lock()
#: The nodes whose backward is running now, one entry per call.
_running: list[BackwardCFunction] = []
#: ids of nodes whose release waits for the calls still running through them.
_due: set[int] = set()
#: Stands in ctx.__dict__[RELEASED] while a release decides.
_DECIDING: tuple[str, ...] = ()


def release(ctx: BackwardCFunction, names: frozenset[str] | None, keep: frozenset[str]) -> None:
    """Release ``ctx``'s state now, or leave it due to the last call still running through it.

    ``names=None`` releases every attribute but ``keep`` and metadata; a set of names
    releases those. Either way each released attribute is set to ``None`` (library code
    that tests ``ctx.attr is None`` keeps working, as with upstream fixes) and the
    ``RELEASED`` marker names them, so a later backward through the node is refused with
    a message that says what was released.
    """
    state = ctx.__dict__
    if names is None:
        for v in state.values():  # the common case first: metadata only, nothing to do
            if type(v) not in METADATA_TYPES:
                break
        else:
            if _due:  # a due entry must not outlive the node: a later one may reuse its id
                _due.discard(id(ctx))
            return
        gone = [
            n
            for n, v in state.items()
            if type(v) not in METADATA_TYPES and n not in keep and not holds_no_memory(v)
        ]
    else:
        gone = [n for n in names if state.get(n) is not None]
    key = id(ctx)
    if not gone:
        # Metadata only (a common case): nothing to free, nothing to race with. A due
        # entry must not outlive the node: a later node may reuse its id.
        if _due:
            _due.discard(key)
        return
    with _state_lock:
        if state.get(RELEASED):
            _due.discard(key)
            return  # another thread's release got here first
        _due.add(key)
        state[RELEASED] = _DECIDING  # publish, then look
        if ctx in _running:
            del state[RELEASED]  # withdraw: the call still running releases when it returns
            return
        _due.discard(key)
        taken = [state.get(n) for n in gone]
        for n in gone:
            state[n] = None
        state[RELEASED] = tuple(gone)
    del taken  # outside the lock: a destructor may run arbitrary code


def _refuse_if_released(ctx: BackwardCFunction) -> None:
    """A call registered in ``_running`` found ``RELEASED`` on entry: a release is deciding,
    or has decided. Take the lock to see which; if released, unregister and raise."""
    with _state_lock:
        if ctx.__dict__.get(RELEASED):
            _running.remove(ctx)
            _raise_released(ctx)


def _leave(
    ctx: BackwardCFunction, names: frozenset[str] | None, keep: frozenset[str], last: bool
) -> None:
    """Unregister a call; release if it was the node's last use or if a release waits
    for it (see :func:`_run_backward`)."""
    _running.remove(ctx)
    if last or (_due and id(ctx) in _due):
        release(ctx, names, keep)


def _release_if_saved_freed(
    ctx: BackwardCFunction, names: frozenset[str] | None, keep: frozenset[str]
) -> None:
    # Fallback when the engine cannot tell us whether the graph is kept: the pass has just
    # ended; if it released this node's saved variables, the node is done.
    if backward_ran(ctx):
        release(ctx, names, keep)


def is_last_backward(ctx: BackwardCFunction, method: str, wrapper: Callable[..., Any]) -> bool:
    """Is the call of ``wrapper`` that is returning now the last use of ``ctx``'s node?

    Yes when the engine runs ``ctx``'s node in a pass that does not keep the graph. Not
    when the graph is kept (``retain_graph``, ``create_graph``: grad mode is on inside
    such a backward and its new graph may still read ctx), not when ``ctx`` is not the
    node being executed (its backward called by hand from another node), and not when
    another Function's backward delegated to this one (:func:`_dispatched`). Needs the
    engine's keep-graph query (``_keep_graph``); without it the end of the pass decides
    (:func:`_release_if_saved_freed`).
    """
    return (
        _keep_graph is not None
        and not _keep_graph()
        and not _grad_enabled()
        and (_current_node is None or _current_node() is ctx)
        # _dispatched, without its call: this runs once per node per backward
        and (_dispatch_cache.get(type(ctx)) or _dispatch_target(ctx, method)) is wrapper
    )


#: node class -> the backward function autograd dispatches for it (cleared on (un)install).
_dispatch_cache: dict[type, Any] = {}


def _dispatch_target(node: BackwardCFunction, method: str) -> Any:
    """The backward function autograd dispatches for ``node`` (cached per node class)."""
    fn = getattr(node._forward_cls, method, None)  # type: ignore[attr-defined]
    fn = _dispatch_cache[type(node)] = getattr(fn, "__func__", fn)
    return fn


def _dispatched(node: BackwardCFunction, method: str, wrapper: Callable[..., Any]) -> bool:
    """Is ``wrapper`` the backward autograd dispatched for ``node``?

    False when another Function's backward delegates to this one (``B.backward`` calling
    ``A.backward(ctx, g)``): then B's wrapper, with B's ``keep``, does the release.
    """
    return (_dispatch_cache.get(type(node)) or _dispatch_target(node, method)) is wrapper


def _raise_released(ctx: Any) -> None:
    cls = ctx._forward_cls
    names = ", ".join(ctx.__dict__.get(RELEASED, ())) or "none"
    raise RuntimeError(
        f"Trying to backward through {cls.__qualname__} a second time, but leakfree "
        f"released its ctx state ({names}) after the first backward. Pass "
        "retain_graph=True to every backward except the last, or list the attributes "
        f"in {cls.__qualname__}.keep."
    )


def _run_backward(
    backward: Callable[..., Any],
    ctx: Any,
    grads: tuple[Any, ...],
    names: frozenset[str] | None,
    keep: frozenset[str],
    method: str,
    wrapper: Callable[..., Any],
) -> Any:
    """Run the user's ``backward(ctx, *grads)`` inside the node lifecycle: register the
    call (refusing it after a release), run it, then unregister with "was this the node's
    last use?" and release if so. Every installed wrapper runs exactly this, once per node
    per backward pass; "last use" is :func:`is_last_backward`, the release is
    :func:`release`.
    """
    if not isinstance(ctx, BackwardCFunction):
        return backward(ctx, *grads)  # compiled autograd's proxy ctx: not ours to touch
    _running.append(ctx)  # register before looking at ctx (see the protocol above)
    if RELEASED in ctx.__dict__:
        _refuse_if_released(ctx)
    try:
        result = backward(ctx, *grads)
    except BaseException:
        _leave(ctx, names, keep, False)  # that pass did not finish: the node is not used up
        raise
    if _keep_graph is not None:
        # The last use, decided here; released right away, as upstream fixes do
        # (`ctx.x = None` in backward): each node's state goes as the pass moves on, so
        # peak memory during backward drops too.
        _leave(ctx, names, keep, is_last_backward(ctx, method, wrapper))
    else:
        _leave(ctx, names, keep, False)
        if _queue_callback is not None and _dispatched(ctx, method, wrapper):
            _queue_callback(functools.partial(_release_if_saved_freed, ctx, names, keep))
    return result


def _make_backward(
    raw: Any, method: str, names: frozenset[str] | None, keep: frozenset[str]
) -> Any:
    """A descriptor like ``raw`` (staticmethod, classmethod or function) whose function
    runs the user's backward through :func:`_run_backward`."""
    user = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    # The closures hold only what dynamo can wrap (it traces these wrappers).

    if isinstance(raw, classmethod):

        @functools.wraps(user)
        def backward_cm(cls: type, ctx: Any, *grad_outputs: Any) -> Any:
            if _is_compiling():  # see backward below
                return user(cls, ctx, *grad_outputs)
            return _run_backward(
                types.MethodType(user, cls), ctx, grad_outputs, names, keep, method, backward_cm
            )

        setattr(backward_cm, _ORIGINAL, raw)
        return classmethod(backward_cm)

    @functools.wraps(user)
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        if _is_compiling():
            # Traced by dynamo: AOTAutograd owns lifetimes in compiled regions, and neither
            # the engine queries nor the spec object are traceable.
            return user(ctx, *grad_outputs)
        return _run_backward(user, ctx, grad_outputs, names, keep, method, backward)

    setattr(backward, _ORIGINAL, raw)
    return staticmethod(backward)


def backward_name(cls: type) -> str | None:
    """Which of ``backward`` / ``vjp`` the class implements (autograd calls that one)."""
    if getattr(cls, "vjp", None) is not torch.autograd.Function.vjp:
        return "vjp"
    if getattr(cls, "backward", None) is not torch.autograd.Function.backward:
        return "backward"
    return None


def _raw_attribute(cls: type, name: str) -> tuple[type, Any]:
    """The class along the MRO that defines ``name``, and its raw ``__dict__`` entry."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass, klass.__dict__[name]
    raise AttributeError(name)  # pragma: no cover  (backward_name found it)


def _unwrap(raw: Any) -> Any:
    fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    return getattr(fn, _ORIGINAL, raw)


class ReleaseHandle:
    """What :func:`release_after_backward` installed on one class; ``restore()`` undoes it.

    Also a context manager: ``with release_after_backward(Cls): ...`` restores on exit.
    """

    def __init__(
        self,
        cls: type[torch.autograd.Function],
        method: str,
        own_raw: Any,
        names: frozenset[str] | None,
        keep: frozenset[str],
    ) -> None:
        self.cls = cls
        self.method = method
        self._own_raw = own_raw  # the class's own __dict__ entry, or None if it inherited
        self.names = names
        self.keep = keep
        self._installed: Any = None  # the wrapper put in the class's __dict__

    @property
    def attrs(self) -> tuple[str, ...] | Literal["all"]:
        """What is released: ``"all"`` (all ctx state, minus ``keep`` and metadata), or the
        names, sorted."""
        return "all" if self.names is None else tuple(sorted(self.names))

    @property
    def active(self) -> bool:
        return self.cls.__dict__.get(HANDLE) is self

    def restore(self) -> bool:
        """Put back the exact original ``backward`` / ``vjp``; True once it is back.
        Idempotent.

        Only while leakfree's wrapper is still the class's method: if something wrapped it
        since (another patcher, a profiler), taking ours out would silently drop theirs, so
        it is left as it is, a :class:`~leakfree.LeakfreeWarning` says so, and False is
        returned (the release stays on: undo the outer wrapper first, then restore)."""
        with _lock:
            if not self.active:
                return True
            if self.cls.__dict__.get(self.method) is not self._installed:
                warnings.warn(
                    f"release_after_backward({self.cls.__qualname__}).restore(): "
                    f"{self.cls.__qualname__}.{self.method} was wrapped again after leakfree "
                    "wrapped it; left in place (restoring would drop that wrapper). Undo "
                    "the outer wrapper first, then call restore() again.",
                    LeakfreeWarning,
                    stacklevel=2,
                )
                return False
            if self._own_raw is None:
                delattr(self.cls, self.method)
            else:
                setattr(self.cls, self.method, self._own_raw)
            delattr(self.cls, HANDLE)
            _dispatch_cache.clear()
            return True

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
        current: ReleaseHandle | None = cls.__dict__.get(HANDLE)
        if current is not None:
            if current.names == names and current.keep == keep:
                return current  # idempotent
            current.restore()  # re-install from the original with the new spec
        method = backward_name(cls)
        if method is None:
            return None
        _, raw = _raw_attribute(cls, method)
        # An inherited backward may already be one of ours: wrap what the user wrote.
        original = _unwrap(raw)
        own_raw = cls.__dict__.get(method)
        handle = ReleaseHandle(cls, method, own_raw, names, keep)
        handle._installed = _make_backward(original, method, names, keep)
        setattr(cls, method, handle._installed)
        setattr(cls, HANDLE, handle)
        _dispatch_cache.clear()
        return handle


def release_after_backward(
    cls: type[torch.autograd.Function], attrs: Iterable[str] | Literal["all"] = "all"
) -> ReleaseHandle:
    """Release ``ctx`` state of an existing Function class after its last backward.

    Wraps the class's ``backward`` (or ``vjp``) in place. Autograd looks ``backward`` up on
    the class at backward time, so graphs built *before* this call are covered too.

    Args:
        cls: a :class:`torch.autograd.Function` subclass, typically one you do not own.
            (A :class:`leakfree.Function` subclass already releases; use its ``keep``.)
        attrs: ``"all"`` releases every attribute forward / ``setup_context`` / backward
            set on ``ctx``, except metadata that holds no memory (numbers, strings, dtypes,
            shapes); a collection of names releases only those. Either way a released
            attribute is set to ``None``, as upstream fixes such as Transformer Engine
            2.15's do, and another backward through the node is refused, naming them.

    Returns:
        A :class:`ReleaseHandle`; ``handle.restore()`` puts the original method back. Calling
        again with the same ``attrs`` returns the same handle; with other ``attrs`` the new
        choice replaces the old one (the original is still what ``restore()`` puts back).

    The release happens when the engine runs the node in a backward pass that does not keep
    the graph, right after the node's backward returns (before node post-hooks; after the
    last of several concurrent backward calls through the node). Subclasses
    that inherit the patched method inherit the release; a subclass that defines its own
    backward is not patched.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        raise TypeError(
            f"release_after_backward(cls={cls!r}): expected a torch.autograd.Function "
            "subclass. For a Function you write yourself, subclass leakfree.Function."
        )
    if issubclass(cls, Function):
        raise TypeError(
            f"release_after_backward({cls.__qualname__}): it is a leakfree.Function, which "
            "already releases its ctx state after backward; list what must stay in "
            f"{cls.__qualname__}.keep instead."
        )
    handle = _install(cls, release_choice("release_after_backward", attrs), frozenset())
    if handle is None:
        raise TypeError(
            f"release_after_backward({cls.__qualname__}): the class defines neither backward "
            "nor vjp, so there is no backward after which to release its ctx state."
        )
    return handle


def release_choice(where: str, attrs: Any) -> frozenset[str] | None:
    """The one check of an ``attrs`` argument: ``"all"`` (None here) or a collection of
    attribute names; a ``TypeError`` naming ``where`` otherwise."""
    if attrs == "all":
        return None
    if attrs is None:
        raise TypeError(
            f'{where}(attrs=None): write attrs="all" to release all ctx state, or a tuple '
            "of the attribute names to release"
        )
    if isinstance(attrs, str) or not isinstance(attrs, Iterable):
        hint = f"attrs=({attrs!r},)" if isinstance(attrs, str) else 'attrs=("name", ...)'
        raise TypeError(
            f'{where}(attrs={attrs!r}): attrs is "all" or a collection of names; write {hint}'
        )
    names = frozenset(attrs)
    bad = [a for a in names if not (isinstance(a, str) and a.isidentifier())]
    if bad:
        raise TypeError(f"{where}(attrs=...): not attribute names: {bad!r}")
    return names


def released_attributes(cls: type) -> tuple[str, ...] | Literal["all"]:
    """What a class releases after its last backward: ``"all"`` (all ctx state, minus
    ``keep`` and metadata: a :class:`Function`, or ``release_after_backward(cls)``), the
    names it releases, or ``()``: nothing (no release is installed for the backward that
    autograd runs for it). A class that is not an autograd Function releases nothing;
    anything that is not a class is refused (``released_attributes(3)``)."""
    if not isinstance(cls, type):
        raise TypeError(f"released_attributes(cls={cls!r}): expected a class")
    if not issubclass(cls, torch.autograd.Function):
        return ()
    method = backward_name(cls)
    if method is None:
        return ()
    _, raw = _raw_attribute(cls, method)
    if _unwrap(raw) is raw:
        return ()  # the backward autograd will run is not one of ours
    for klass in cls.__mro__:
        handle = klass.__dict__.get(HANDLE)
        if handle is not None:
            attrs: tuple[str, ...] | Literal["all"] = handle.attrs
            return attrs
    return ()  # pragma: no cover


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


def _find_output(value: Any, targets: dict[int, int]) -> tuple[int, str] | None:
    """Index of the output that ``value`` is, views, or holds (see :mod:`leakfree._walk`
    for what is searched), and the path to it inside ``value``."""

    def match(t: torch.Tensor) -> int | None:
        hit = targets.get(id(t))
        if hit is None:
            base = t._base
            if base is not None:
                hit = targets.get(id(base))
        return hit

    return search(value, match)


def _check_no_output_on_ctx(cls: type, result: Any) -> None:
    """Raise :class:`ReferenceCycleError` if this call's ctx holds one of its outputs."""
    outputs = result if type(result) is tuple else (result,)
    node = None
    for out in outputs:
        if isinstance(out, torch.Tensor):
            node = out.grad_fn
            if node is not None:
                break
    if node is None or type(node) is not cls._backward_cls:  # type: ignore[attr-defined]
        return  # no output requires grad: no graph, no cycle
    # The hot path of every apply ends here: a ctx.__dict__ holding only metadata, or
    # objects whose class declares itself opaque (the walk would not enter them anyway).
    for value in node.__dict__.values():
        kind = type(value)
        if kind not in SCALAR_TYPES and not kind.__dict__.get(OPAQUE, False):
            _check_state(cls, outputs, node)
            return


def _check_state(cls: type, outputs: tuple[Any, ...], node: Any) -> None:
    if _is_compiling():
        return  # traced by dynamo: the node it sees is not one that will run
    state = node.__dict__
    targets = None
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            # A tensor directly on ctx (an input, a weight, a buffer): the common case,
            # answered without a walk unless it is an output, a view of one, or carries
            # attributes of its own.
            base = value._base
            for o in outputs:
                if value is o or (base is not None and base is o):
                    break
            else:
                if not value.__dict__:
                    continue
        elif is_scalar(value):
            continue
        if targets is None:
            # Only outputs whose grad_fn is this node close a cycle through ctx: a
            # non-differentiable output (indices, argmax) has no grad_fn and is fine on ctx.
            targets = {
                id(o): i
                for i, o in enumerate(outputs)
                if isinstance(o, torch.Tensor) and o.grad_fn is node
            }
        found = _find_output(value, targets)
        if found is not None:
            index, path = found
            state.clear()  # break the cycle before reporting it
            raise ReferenceCycleError(
                f"{cls.__qualname__} stored output {index} (or a view of it) on "
                f"ctx.{name}{path}. That output's grad_fn is this ctx, so output -> ctx -> "
                "output is a reference cycle that outlives the graph (for a view, even gc "
                "cannot free it). Save it with ctx.save_for_backward(...) and read it from "
                "ctx.saved_tensors in backward: autograd saves outputs without the cycle. "
                "(Non-differentiable outputs, and .detach()ed copies, may stay on ctx.)"
            )


def _class_method(owner: type, name: str) -> Callable[..., Any]:
    """``owner.name``, a class method, as a function taking the class first: the function
    of a Python ``classmethod`` (``torch.autograd.Function.apply`` up to torch 2.13), or a
    C ``classmethod_descriptor`` as it is (from 2.14, ``_FunctionBase.apply``), which is
    called with the class first too. Either way no class is bound in advance: a subclass
    passes itself."""
    raw = next(vars(k)[name] for k in owner.__mro__ if name in vars(k))
    if isinstance(raw, classmethod):
        return raw.__func__  # type: ignore[no-any-return]
    return raw  # type: ignore[no-any-return]


_function_apply = _class_method(torch.autograd.Function, "apply")


class Function(torch.autograd.Function):
    """Drop-in for :class:`torch.autograd.Function` whose ``ctx`` state cannot outlive its use.

    Write forward / setup_context / backward / jvp / vmap exactly as for
    ``torch.autograd.Function``. On top of PyTorch's behaviour:

    * **Released after the last backward**: every attribute set on ``ctx`` (by forward,
      setup_context, jvp or backward) that can hold memory, right after the node's backward
      returns in a pass that does not keep the graph. ``backward(retain_graph=True)`` and
      ``create_graph=True`` keep it for the next pass. A released attribute is set to
      ``None`` (reading it gives ``None``); another backward through the node raises a
      ``RuntimeError`` that says what happened. Node post-hooks run after the release.
      Backward calls that run through one node concurrently (threads) all see the whole
      state; the last one out releases it.
    * **Kept**: autograd-managed state (``saved_tensors``, ``needs_input_grad``, ...);
      attributes listed in the class attribute ``keep`` (``keep = ("cache",)``), which then
      live as long as the node, as in plain PyTorch; metadata that holds no memory
      (numbers, strings, ``None``, dtypes, devices, shapes, enums, tuples of these); and all
      state of a node that no backward reached, until the graph is dropped.
    * **Refused**: storing on ``ctx`` an output whose ``grad_fn`` is this node, or a view of
      one, anywhere a Python walk from ``ctx`` reaches (containers, dict keys, deques,
      closures, ``functools.partial``, object attributes and slots; see
      :mod:`leakfree._walk` for exactly what is and is not searched):
      :class:`ReferenceCycleError` is raised when ``apply`` returns, naming the attribute
      and the path. Use ``ctx.save_for_backward``. Non-differentiable outputs (marked, or
      integer, such as top-k indices) have no ``grad_fn``, make no cycle, and may stay.

    ``keep`` is read when the class is created; subclasses inherit it and may override it.

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
