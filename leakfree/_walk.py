"""Walk the Python objects reachable from a value, down to the tensors they hold.

One walker serves every "what does this object keep alive?" question leakfree asks: the
output-on-ctx check of :class:`leakfree.Function` (on the hot path of every ``apply``) and
:func:`leakfree.diagnostics.find_retained`.

What is searched
----------------
From a value, the walk follows strong references a Python program can create:

* tensors themselves, and the attributes set on them (``t.__dict__``, tensor subclasses);
* the keys *and* values of every ``dict`` (``OrderedDict``, ``defaultdict``, ``Counter``...)
  and of ``types.MappingProxyType``;
* the items of lists, tuples (named tuples too), sets, frozensets and ``collections.deque``,
  and of their subclasses, plus the subclass instance's own attributes;
* functions: closure cells, ``__defaults__``, ``__kwdefaults__`` and function attributes;
  bound methods (``__self__`` and the function); ``functools.partial`` (``func``, ``args``,
  ``keywords``); ``lambda: v`` is a function with a closure cell;
* any other object: its ``__dict__`` and ``__slots__`` (read without running properties;
  a ``collections.ChainMap`` is walked through its ``maps``), and, for a C-level object
  with neither, what ``gc.get_referents`` reports;
* with ``classes=True`` (diagnostics only): the class attributes of every walked object's
  class and of its bases (``class Model: history = []`` is shared by every instance and
  lives as long as the class), except classes defined by Python itself or by torch, names
  with double underscores, and descriptors (functions, properties, ``staticmethod``...).
  Such a path starts at the class: ``Model.history[3]``. Also the hooks registered on
  every walked tensor (``weight._backward_hooks[7]<closure>``): a hook added to a
  parameter every step keeps what its closure holds for as long as the parameter lives.
  And what Python keeps out of sight: an exception's traceback (the locals of every frame
  from where it was caught to where it was raised: ``errors[3].__traceback__<frame
  inner>.act``), its ``__cause__`` and ``__context__``, and the entries of a
  ``functools.lru_cache`` / ``functools.cache`` (``anchors<cache>[16]``; cached methods
  too, as class attributes, under a dunder name such as ``__getitem__``, a ``property``, a
  ``staticmethod`` or a ``classmethod``).

What is not searched
--------------------
Instances of classes that declare themselves opaque (:data:`OPAQUE`), classes (unless
``classes=True``), modules,
code objects, builtin functions, a function's ``__globals__``,
``torch.nn.Module`` instances (model state that lives anyway; walking it would visit
every parameter on every ``apply``), weak references (they keep nothing alive), and what
lives only in C++ (an autograd node's saved tensors, a C extension's fields that
``gc.get_referents`` does not report). Each object is visited once (with ``again=True`` a
tensor met again from another holder is yielded again, not walked into); a walk stops after
:data:`MAX_OBJECTS` objects, so a pathological structure cannot stall the caller.
"""

from __future__ import annotations

import collections
import enum
import functools
import gc
import inspect
import itertools
import sys
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

#: Types whose instances hold no tensor and no other object: never walked into.
SCALARS: tuple[type, ...] = (
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.Size,
)
#: The same, for exact-type membership tests on hot paths.
SCALAR_TYPES: frozenset[type] = frozenset(SCALARS)
#: Exact types whose values are small metadata (bytes can be a payload): see holds_no_memory.
METADATA_TYPES: frozenset[type] = SCALAR_TYPES - {bytes}

#: A class that sets this attribute to True in its own body is not walked into: its
#: instances declare that they never hold what a walk looks for (pipeline's GradSlot holds
#: gradients, never the activation whose node it sits on).
OPAQUE = "__leakfree_opaque__"

#: A walk visits at most this many objects.
MAX_OBJECTS = 10_000


def is_scalar(value: Any) -> bool:
    """True for values that cannot hold a tensor: numbers, strings, dtypes, enum members."""
    return type(value) in SCALAR_TYPES or isinstance(value, (*SCALARS, enum.Enum))


def holds_no_memory(value: Any) -> bool:
    """True for small immutable metadata: a scalar, or a tuple of scalars (a shape, dims).

    These are what :class:`leakfree.Function` leaves on ``ctx`` after the release: they
    cost nothing to keep, and a backward that reads only them can run again.
    """
    if type(value) in METADATA_TYPES:
        return True
    if type(value) is tuple:
        return all(type(v) in METADATA_TYPES for v in value)
    return isinstance(value, enum.Enum)


def object_fields(obj: Any) -> dict[str, Any]:
    """An object's instance attributes and slots, read without running properties."""
    try:
        fields = dict(object.__getattribute__(obj, "__dict__"))
    except Exception:
        fields = {}
    for name in _slot_names(type(obj)):
        try:
            fields[name] = object.__getattribute__(obj, name)
        except Exception:  # an unset slot, or a descriptor that raises
            continue
    return fields


_slot_cache: dict[type, tuple[str, ...]] = {}


def _slot_names(cls: type) -> tuple[str, ...]:
    names = _slot_cache.get(cls)
    if names is None:
        found: list[str] = []
        for klass in cls.__mro__:
            slots = klass.__dict__.get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name not in ("__dict__", "__weakref__"):
                    found.append(name)
        names = _slot_cache[cls] = tuple(found)
    return names


# --- children of one object, by type --------------------------------------------------------
# Each handler yields (label, child): the label is only formatted into a path on a hit.

Edge = tuple[str, Any]


def _no_children(obj: Any) -> Iterable[Edge]:
    return ()


def _mapping(obj: Any) -> Iterator[Edge]:
    for k, v in list(obj.items()):
        yield "key", k
        yield _key_label(k), v


def _key_label(key: Any) -> str:
    """``['lm']``, ``[3]``; a key that is not a plain value by its type (an optimizer's
    state is keyed by parameters, whose ``repr`` prints every value): ``[<Parameter>]``."""
    if type(key) in _PLAIN_KEYS:
        return f"[{key!r}]"
    if type(key) is tuple and all(type(k) in _PLAIN_KEYS for k in key):
        return f"[{key!r}]"
    return f"[<{type(key).__name__}>]"


_PLAIN_KEYS = (str, int, float, bool, type(None), bytes)


def _sequence(obj: Any) -> Iterator[Edge]:
    for i, v in enumerate(list(obj)):
        yield f"[{i}]", v


def _unordered(obj: Any) -> Iterator[Edge]:
    for v in list(obj):
        yield "{...}", v


def _fields(obj: Any) -> Iterator[Edge]:
    for name, v in object_fields(obj).items():
        yield f".{name}", v


def _subclass_of(handler: Callable[[Any], Iterable[Edge]]) -> Callable[[Any], Iterator[Edge]]:
    def walk(obj: Any) -> Iterator[Edge]:
        yield from handler(obj)
        yield from _fields(obj)

    return walk


def _function(fn: types.FunctionType) -> Iterator[Edge]:
    for cell in fn.__closure__ or ():
        try:
            yield "<closure>", cell.cell_contents
        except ValueError:  # an empty cell
            continue
    for i, v in enumerate(fn.__defaults__ or ()):
        yield f"<default {i}>", v
    for k, v in (fn.__kwdefaults__ or {}).items():
        yield f"<default {k}>", v
    yield from _fields(fn)


def _method(m: types.MethodType) -> Iterator[Edge]:
    yield ".__self__", m.__self__
    yield ".__func__", m.__func__


def _partial(p: functools.partial[Any]) -> Iterator[Edge]:
    yield ".func", p.func
    for i, v in enumerate(p.args):
        yield f".args[{i}]", v
    for k, v in p.keywords.items():
        yield f".keywords[{k!r}]", v
    yield from _fields(p)


def _cell(c: types.CellType) -> Iterator[Edge]:
    try:
        yield ".cell_contents", c.cell_contents
    except ValueError:
        return


def _tensor(t: torch.Tensor) -> Iterator[Edge]:
    # Attributes set on a tensor (or a subclass's fields) can hold other tensors.
    try:
        fields = object.__getattribute__(t, "__dict__")
    except Exception:
        return
    for name, v in list(fields.items()):
        yield f".{name}", v


_HOOK_TABLES = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _tensor_hooks(t: torch.Tensor) -> Iterator[Edge]:
    """The hooks registered on a tensor (``register_hook``, ``register_post_accumulate_
    grad_hook``): their closures outlive every step when the tensor is a parameter."""
    for name in _HOOK_TABLES:
        try:
            table = getattr(t, name, None)
        except Exception:
            continue
        if table:
            yield f".{name}", table


def _exception(e: BaseException) -> Iterator[Edge]:
    """What a kept exception keeps: its traceback, and the exceptions chained to it."""
    yield ".__traceback__", e.__traceback__
    yield ".__cause__", e.__cause__
    yield ".__context__", e.__context__


def _traceback(tb: types.TracebackType) -> Iterator[Edge]:
    """The locals of each frame along a traceback (from where it was caught to where it
    was raised; not the frames above, which are the running stack's own)."""
    at: types.TracebackType | None = tb
    while at is not None:
        frame = at.tb_frame
        where = f"<frame {frame.f_code.co_name}>"
        for name, v in frame_locals(frame):
            yield f"{where}.{name}", v
        at = at.tb_next


def frame_locals(frame: types.FrameType) -> list[tuple[str, Any]]:
    """A frame's local variables, without leaving them held.

    Before Python 3.13 ``frame.f_locals`` of a function's frame is a snapshot dict cached
    on the frame: it would keep this iteration's locals (a batch, the outputs) alive after
    the loop rebinds them, until the frame ends (the frame that caught a kept exception
    is often the training loop itself, still running). A watcher must not cause what it
    looks for, so the snapshot is emptied again after reading (the next reader refills
    it), unless someone else holds it (a ``d = locals()`` of the function's own: it is
    theirs). From 3.13 ``f_locals`` is a view (PEP 667): nothing to undo.
    """
    namespace = frame.f_locals
    items = list(namespace.items())
    if (
        type(namespace) is dict
        and frame.f_code.co_flags & inspect.CO_OPTIMIZED
        and namespace is not frame.f_globals
        # the frame's reference, ours, getrefcount's argument: nobody else holds it
        and sys.getrefcount(namespace) <= 3
    ):
        namespace.clear()
    return items


_LRU = getattr(functools, "_lru_cache_wrapper", None)


def _cache(fn: Any) -> Iterator[Edge]:
    """A ``functools.lru_cache``'s entries, which only the collector sees: an unbounded
    cache's ``{key: result}`` dict; a bounded one's keys and results, as one list."""
    own = getattr(fn, "__dict__", None)
    wrapped = getattr(fn, "__wrapped__", None)
    entries = []
    for v in gc.get_referents(fn):
        if isinstance(v, type) or v is own or v is wrapped or type(v) is object:
            continue
        if isinstance(v, dict):
            yield "<cache>", v
        else:
            entries.append(v)
    if entries:
        yield "<cache>", entries


def _indirect(obj: Any) -> Iterable[Edge]:
    """The edges a diagnostics walk adds to an object's own (see the module doc)."""
    if isinstance(obj, BaseException):
        return _exception(obj)
    if isinstance(obj, types.TracebackType):
        return _traceback(obj)
    if _LRU is not None and isinstance(obj, _LRU):
        return _cache(obj)
    return ()


def _other(obj: Any) -> Iterator[Edge]:
    kind = type(obj)
    if kind.__dictoffset__ or _slot_names(kind):
        yield from _fields(obj)
        return
    # A C-level object without __dict__ or slots: what the collector knows it holds (an
    # autograd node: its tables of hooks, with their closures).
    label = "<hooks>" if isinstance(obj, torch.autograd.graph.Node) else None
    for i, v in enumerate(gc.get_referents(obj)):
        if not isinstance(v, type):
            yield label or f"<ref {i}>", v


_SKIP: tuple[type, ...] = (
    *SCALARS,
    enum.Enum,
    type,
    types.ModuleType,
    types.CodeType,
    types.BuiltinFunctionType,
    types.FrameType,
    weakref.ReferenceType,
    weakref.ProxyType,
    weakref.CallableProxyType,
    torch.nn.Module,
)

# isinstance order matters: the first match decides.
_BY_BASE: tuple[tuple[type | tuple[type, ...], Callable[[Any], Iterable[Edge]]], ...] = (
    (_SKIP, _no_children),
    (torch.Tensor, _tensor),
    ((dict, types.MappingProxyType), _mapping),
    ((list, tuple, collections.deque), _sequence),
    ((set, frozenset), _unordered),
    (types.FunctionType, _function),
    (types.MethodType, _method),
    (functools.partial, _partial),
    (types.CellType, _cell),
)
_EXACT = {dict, list, tuple, set, frozenset, collections.deque, types.MappingProxyType}

#: type -> its handler, resolved once per type.
_handlers: dict[type, Callable[[Any], Iterable[Edge]]] = {}


def _handler(kind: type) -> Callable[[Any], Iterable[Edge]]:
    handler = _handlers.get(kind)
    if handler is None:
        if kind.__dict__.get(OPAQUE, False):
            handler = _handlers[kind] = _no_children
            return handler
        for base, candidate in _BY_BASE:
            if issubclass(kind, base):
                handler = candidate
                if candidate in (_mapping, _sequence, _unordered) and kind not in _EXACT:
                    handler = _subclass_of(candidate)  # named tuples, list subclasses...
                break
        else:
            handler = _other
        _handlers[kind] = handler
    return handler


def edges_of(obj: Any) -> list[Edge]:
    """``(label, child)`` for each object ``obj`` holds, as a walk sees them (without the
    ``"key"`` edges of mappings); empty when reading them fails."""
    try:
        return [(label, child) for label, child in _handler(type(obj))(obj) if label != "key"]
    except Exception:
        return []


def _class_fields(cls: type) -> Iterator[Edge]:
    """A class's own data attributes: what a ``class C: registry = []`` keeps alive, and the
    caches of its cached methods (``@lru_cache`` on ``__getitem__`` too, and under a
    ``property``, a ``staticmethod`` or a ``classmethod``): they live with the class."""
    for name, v in list(vars(cls).items()):
        cached = _cached(v)
        if cached is not None:
            yield f".{name}", cached
            continue
        if name.startswith("__") and name.endswith("__"):
            continue
        if isinstance(v, type) or hasattr(type(v), "__get__"):  # methods, properties...
            continue
        yield f".{name}", v


def _cached(v: Any) -> Any:
    """The ``functools.lru_cache`` wrapper a class attribute is or wraps (a property's
    getter, setter or deleter; a static or class method's function), or None."""
    if _LRU is None:
        return None
    if isinstance(v, _LRU):
        return v
    if isinstance(v, property):
        return next((f for f in (v.fget, v.fset, v.fdel) if isinstance(f, _LRU)), None)
    if isinstance(v, (staticmethod, classmethod)) and isinstance(v.__func__, _LRU):
        return v.__func__
    return None


#: type -> the classes along its MRO whose attributes a ``classes=True`` walk visits.
_class_chains: dict[type, tuple[type, ...]] = {}


def _own_module(cls: type) -> bool:
    module = str(getattr(cls, "__module__", ""))
    return module not in ("builtins", "abc", "typing", "enum") and not (
        module == "torch" or module.startswith("torch.")
    )


def _class_chain(kind: type) -> tuple[type, ...]:
    chain = _class_chains.get(kind)
    if chain is None:
        if issubclass(kind, torch.Tensor) or (
            issubclass(kind, _SKIP) and not issubclass(kind, torch.nn.Module)
        ):
            chain = ()
        else:
            chain = tuple(c for c in kind.__mro__ if _own_module(c))
        _class_chains[kind] = chain
    return chain


#: A label that starts a path afresh (a class attribute is reached from the class).
_ABSOLUTE = "\0"

R = TypeVar("R")


class Located:
    """Where a walk found a tensor: call it for the path from the root; :meth:`holders`
    gives the objects along that path. Built only on a hit; keeps the walk's trail."""

    __slots__ = ("_at", "_trail")

    def __init__(self, trail: list[tuple[int, str, Any]], at: int) -> None:
        self._trail = trail
        self._at = at

    def __call__(self) -> str:
        return _path(self._trail, self._at)

    def named(self, root: str) -> str:
        """The path, prefixed with ``root``'s name unless it starts at a class."""
        path = _path(self._trail, self._at)
        return path if self._absolute() else root + path

    def _absolute(self) -> bool:
        at = self._at
        while at >= 0:
            parent, label, _ = self._trail[at]
            if label.startswith(_ABSOLUTE):
                return True
            at = parent
        return False

    def above(self, levels: int) -> Located:
        """Where the object ``levels`` edges above this one was found (0: its holder)."""
        at = self._trail[self._at][0]
        for _ in range(levels):
            at = self._trail[at][0]
        return Located(self._trail, at)

    def holder(self) -> Any:
        """The object that holds the tensor directly (None at a root)."""
        at = self._trail[self._at][0]
        return self._trail[at][2] if at >= 0 else None

    def holders(self) -> list[tuple[Any, str]]:
        """``(object, label)`` from the tensor's direct holder up to the root: the label
        is the edge by which that object reached the next one down (``"[3]"``)."""
        out = []
        at = self._trail[self._at][0]
        label = self._trail[self._at][1]
        while at >= 0:
            parent, up, obj = self._trail[at]
            out.append((obj, label))
            at, label = parent, up
        return out


def walk(
    root: Any,
    *,
    limit: int = MAX_OBJECTS,
    depth: int | None = None,
    modules: bool = False,
    visited: set[int] | None = None,
    classes: bool = False,
    again: bool = False,
) -> Iterator[tuple[torch.Tensor, Located]]:
    """Every tensor reachable from ``root``, once each, with a :class:`Located` giving its
    path from ``root`` (built only when called: ``"[0].data"``, ``"['loss']"``...).
    With ``again=True``, a tensor met again from another holder (an object visited for the
    first time, or another root) is yielded again with that holder's path, and not walked
    into twice: every holder of a tensor is named, each object is still visited once.

    ``depth`` bounds how many edges deep the walk goes (None: no bound); ``modules=True``
    also walks into ``torch.nn.Module`` instances (their attributes), which the hot path
    skips; ``classes=True`` (diagnostics) also walks the class attributes of walked
    objects' classes, tensors' hooks, exceptions' tracebacks and ``lru_cache`` entries
    (see the module doc); ``visited`` (object ids) is shared between calls to walk several
    roots once. Stops after ``limit`` visited objects; yields at most ``limit`` tensors met
    again, apart (they do not shorten the walk).
    """
    stack: list[tuple[Any, int, str, int]] = [(root, -1, "", 0)]
    trail: list[tuple[int, str, Any]] = []
    seen = set() if visited is None else visited
    count = repeats = 0
    while stack:
        obj, parent, label, level = stack.pop()
        key = id(obj)
        if key in seen:
            if again and repeats < limit and isinstance(obj, torch.Tensor):
                repeats += 1
                trail.append((parent, label, obj))
                yield obj, Located(trail, len(trail) - 1)
            continue
        seen.add(key)
        count += 1
        if count > limit:
            return
        trail.append((parent, label, obj))
        here = len(trail) - 1
        if isinstance(obj, torch.Tensor):
            yield obj, Located(trail, here)
        if depth is not None and level >= depth:
            continue
        if modules and isinstance(obj, torch.nn.Module):
            children: Iterable[Edge] = _fields(obj)
        elif classes and isinstance(obj, type):
            children = _class_fields(obj) if _own_module(obj) else ()
        else:
            children = _handler(type(obj))(obj)
        if classes:
            if isinstance(obj, torch.Tensor):
                children = itertools.chain(children, _tensor_hooks(obj))
            else:
                children = itertools.chain(children, _indirect(obj))
        for edge, child in itertools.islice(children, limit):
            if type(child) not in SCALAR_TYPES:
                stack.append((child, here, edge, level + 1))
        if classes and not isinstance(obj, type):
            for cls in _class_chain(type(obj)):
                stack.append((cls, here, _ABSOLUTE + cls.__qualname__, level + 1))


def search(
    root: Any, match: Callable[[Any], R | None], *, limit: int = MAX_OBJECTS
) -> tuple[R, str] | None:
    """The first object reachable from ``root`` for which ``match`` returns non-None.

    ``match`` is called on every reachable tensor (and only on tensors). Returns its result
    and the path from ``root`` (``"[0].data"``, ``"key"``...), or None when nothing matched
    within ``limit`` visited objects.
    """
    for tensor, path in walk(root, limit=limit):
        found = match(tensor)
        if found is not None:
            return found, path()
    return None


def _path(trail: list[tuple[int, str, Any]], at: int) -> str:
    parts = []
    while at >= 0:
        parent, label, _ = trail[at]
        if label.startswith(_ABSOLUTE):  # a class attribute: the path starts at the class
            parts.append(label[len(_ABSOLUTE) :])
            break
        parts.append(label)
        at = parent
    return "".join(reversed(parts))
