"""``LossLog``: a per-step loss-logging dict that can never hold an autograd graph.

Training loops keep per-microbatch losses for logging, usually in a
``dict[str, list[Tensor]]``. One entry appended without ``.detach()`` keeps that
microbatch's whole graph alive, with everything its custom Functions left on ``ctx``, until
the step ends: ~164 MiB per microbatch and an OOM at 128 microbatches in one real trainer.
``LossLog`` takes the detaching away from the call sites: every path into it detaches.

Lifetime contract
-----------------
*Stored*: each value's data, detached (a 1-element tensor, or a Python number). Never the
graph: nothing with ``grad_fn`` or ``requires_grad`` gets in, by any path. A value whose
storage is larger than the value itself (``per_sample[3]``, ``per_sample[3].detach()``,
``.data``) is cloned, so the log never pins the bigger storage; so is a value already
modified in place (its version counter is not 0). Any other tensor is stored as a
detached alias, without a copy: if it is modified in place after ``append`` (``total +=
x``, a parameter after ``optimizer.step()``), its version counter moves, and ``reduce``
raises naming the key and the position instead of logging the rewritten number.
*Released*: everything, by :meth:`LossLog.reduce` (unless ``clear=False``) or
:meth:`LossLog.clear`.
*Running mode*: only O(1) accumulators per key (sum, count, min, max) on the values'
device; the appended tensors are not kept at all.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, SupportsIndex, TypeVar, overload

import torch

import leakfree._args as _args
from leakfree._device import device_module

__all__ = ["REDUCTIONS", "LossList", "LossLog", "RunningLoss", "detach_tree"]

# detach_tree has its own module (leakfree.detach); importable from here as before
from leakfree.detach import detach_tree

Reduction = Literal["sum", "mean", "min", "max"]
REDUCTIONS: tuple[str, ...] = ("sum", "mean", "min", "max")
Value = torch.Tensor | float | int

_IDENTITY = {"min": math.inf, "max": -math.inf}

#: seconds :meth:`LossLog.reduce` waits for a collective before it says which group hangs
REDUCE_TIMEOUT = 300.0


class _Owner:
    """The per-log state its entries share: which device the log's tensors live on."""

    __slots__ = ("device", "fixed_device")

    def __init__(self, device: torch.device | None) -> None:
        self.device = device
        self.fixed_device = device is not None


def _check(key: str, value: Any, device: torch.device | None) -> Any:
    """Validate one value and return what to store; raises before anything is stored.

    ``device`` is the device the log's tensors are on (None while nothing chose one yet).
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"LossLog[{key!r}]: expected a 1-element tensor (a scalar loss), got shape "
                f"{tuple(value.shape)}. Reduce it first (e.g. loss.mean()) so that the "
                "reduction you log is the one you meant."
            )
        if device is not None and value.device != device:
            raise ValueError(
                f"LossLog[{key!r}]: tensor on {value.device}, but this log's tensors are on "
                f"{device}. reduce() packs all keys into one tensor: log values from one "
                "device (move it with .to(device) first)."
            )
        if value.is_complex():
            raise TypeError(f"LossLog[{key!r}]: complex tensors are not losses")
        stored = value.detach()
        if value._version or pins_more(value):
            # Modified in place already (the version check at reduce needs 0 here), or
            # sharing a bigger storage (a view, or a detach()/.data of one, whose _base is
            # None): store a copy of the one element.
            stored = stored.clone()
        return stored
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"LossLog[{key!r}]: expected a 1-element tensor or a Python number, "
            f"got {type(value).__name__}"
        )
    return float(value)


def pins_more(value: torch.Tensor) -> bool:
    """Does ``value`` share a storage worth more than a copy of itself (a view of a bigger
    tensor, or a ``detach()`` / ``.data`` of one)? Up to 8 bytes are never worth a copy."""
    try:
        return bool(value.untyped_storage().nbytes() > max(8, value.numel() * value.itemsize))
    except (RuntimeError, NotImplementedError):  # no plain storage (sparse, wrappers...)
        return True


_Tensor = torch.Tensor
_STRIDED = torch.strided


def _admit(key: str, value: Any, owner: _Owner) -> Any:
    """What to store for one value (validated), making its device the log's if unset."""
    if (
        # The per-microbatch fast path: only values _check stores as they are (detached,
        # no copy), each condition one of _check's: a plain 0-d floating-point tensor
        # (a loss; complex, integer and any other kind take the full check), never
        # modified in place, whose storage holds at most 8 bytes (the value, or a sliver:
        # nothing worth a copy), on the log's device.
        type(value) is _Tensor
        and not value._version
        and not value.dim()
        and value.is_floating_point()
        and value.layout is _STRIDED
        and value.untyped_storage().nbytes() <= 8
        and value.device == owner.device
    ):
        return value.detach()
    item = _check(key, value, owner.device)
    if owner.device is None and isinstance(item, torch.Tensor):
        owner.device = item.device
    return item


def _admit_many(key: str, values: Iterable[Any], owner: _Owner) -> list[Any]:
    """Validate a batch as a whole (one device across it) before storing any of it; then
    its device becomes the log's if unset."""
    if isinstance(values, (torch.Tensor, str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(
            f"LossLog[{key!r}]: expected an iterable of values, got {type(values).__name__}; "
            "to add one value use .append(value)"
        )
    device = owner.device
    out: list[Any] = []
    for value in values:
        item = _check(key, value, device)
        if device is None and isinstance(item, torch.Tensor):
            device = item.device
        out.append(item)
    if owner.device is None:
        owner.device = device
    return out


_list_append = list.append


_AL = TypeVar("_AL", bound="AdmittingList")


class AdmittingList(list[Any]):
    """A list whose every entry path stores what :meth:`_admit_many` returns.

    ``append``, ``extend``, ``insert``, ``+=``, ``lst[i] = v`` and ``lst[a:b] = [...]`` all
    pass through it (which validates every value before storing any, then detaches);
    reading, removing and reordering behave as for a plain list. Copies and pickles as a
    plain list of the stored values. The base of :class:`LossList` and of
    :class:`leakfree.pipeline.PipelineLosses`.
    """

    __slots__ = ()

    def _admit_many(self, values: Iterable[Any]) -> list[Any]:
        raise NotImplementedError

    def _admit(self, value: Any) -> Any:
        (stored,) = self._admit_many((value,))
        return stored

    def append(self, value: Any) -> None:
        _list_append(self, self._admit(value))

    def extend(self, values: Iterable[Any]) -> None:
        super().extend(self._admit_many(values))

    def insert(self, index: SupportsIndex, value: Any) -> None:
        super().insert(index, self._admit(value))

    def __iadd__(self: _AL, values: Iterable[Any]) -> _AL:  # type: ignore[override, misc]
        self.extend(values)
        return self

    @overload
    def __setitem__(self, index: SupportsIndex, value: Any) -> None: ...
    @overload
    def __setitem__(self, index: slice, value: Iterable[Any]) -> None: ...
    def __setitem__(self, index: Any, value: Any) -> None:
        if isinstance(index, slice):
            super().__setitem__(index, self._admit_many(value))
        else:
            super().__setitem__(index, self._admit(value))

    def copy(self) -> list[Any]:  # a plain list of the (already admitted) values
        return list(self)

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        return (list, (list(self),))  # pickles/copies as a plain list


class LossList(AdmittingList):
    """The list behind ``log[name]`` in list mode: every entry path stores detached values
    (:class:`AdmittingList`), validated against the log's key and device."""

    __slots__ = ("_key", "_owner")

    def __init__(self, key: str, owner: _Owner, values: Iterable[Any] = ()) -> None:
        self._key = key
        self._owner = owner
        super().__init__(_admit_many(key, values, owner))

    def _admit_many(self, values: Iterable[Any]) -> list[Any]:
        return _admit_many(self._key, values, self._owner)

    def _admit(self, value: Any) -> Any:  # the hot path: one value, no list built
        return _admit(self._key, value, self._owner)

    @classmethod
    def _restore(cls, key: str, owner: _Owner, values: list[Any]) -> LossList:
        """An entry holding ``values`` as stored by another log (already admitted)."""
        entry = cls(key, owner)
        list.extend(entry, _fresh(values))
        return entry


class RunningLoss:
    """The O(1) accumulator behind ``log[name]`` in running mode.

    Keeps ``sum``, ``min`` and ``max`` as tensors on the values' device (updated without
    any host sync) and ``count`` as a Python int. Appended values are folded into the
    accumulators in batches of at most ``FOLD`` (one stack and three reductions per batch,
    instead of kernels per value), so at most ``FOLD`` detached scalars are held at once.
    ``append``, ``extend``, ``+=`` and ``log[name] = [...]`` add values; order-dependent
    list operations (``insert``, indexing) raise ``TypeError``.

    Thread-safe: appends from several threads are each counted once (a lock guards the
    pending batch and the count). ``copy.copy``, ``copy.deepcopy`` and ``pickle`` give an
    independent accumulator with the same totals.
    """

    FOLD = 64

    __slots__ = ("_acc", "_folded", "_key", "_lock", "_owner", "_pending", "count")

    def __init__(self, key: str, owner: _Owner, values: Iterable[Any] = ()) -> None:
        self._key = key
        self._owner = owner
        self._lock = threading.Lock()
        self.count = 0
        self._folded = 0  # how many of `count` are in _acc (positions for errors)
        self._pending: list[Any] = []
        self._acc: torch.Tensor | None = None  # [sum, min, max] in the accumulation dtype
        self.extend(values)

    def append(self, value: Any) -> None:
        item = _admit(self._key, value, self._owner)
        with self._lock:
            self._pending.append(item)
            self.count += 1
            if len(self._pending) >= self.FOLD:
                self._fold_locked()

    def extend(self, values: Iterable[Any]) -> None:
        items = _admit_many(self._key, values, self._owner)
        with self._lock:
            self._pending.extend(items)
            self.count += len(items)
            if len(self._pending) >= self.FOLD:
                self._fold_locked()

    def __iadd__(self, values: Iterable[Any]) -> RunningLoss:
        self.extend(values)
        return self

    def _fold(self) -> torch.Tensor | None:
        """Fold pending values into the accumulators; return ``[sum, min, max]``."""
        with self._lock:
            return self._fold_locked()

    def _fold_locked(self) -> torch.Tensor | None:
        if self._pending:
            pending, self._pending = self._pending, []
            _check_unmodified(self._key, pending, self._folded)
            self._folded += len(pending)
            device = self._owner.device or torch.device("cpu")
            if self._acc is None:
                self._acc = _identity(device, _acc_dtype(device), 3)
            total, low, high = _local(self._key, pending, device, self._acc.dtype)
            acc = self._acc
            acc[0].add_(total)
            torch.minimum(acc[1], low, out=acc[1])
            torch.maximum(acc[2], high, out=acc[2])
        return self._acc

    @property
    def sum(self) -> torch.Tensor | None:
        acc = self._fold()
        return None if acc is None else acc[0]

    @property
    def min(self) -> torch.Tensor | None:
        acc = self._fold()
        return None if acc is None else acc[1]

    @property
    def max(self) -> torch.Tensor | None:
        acc = self._fold()
        return None if acc is None else acc[2]

    def clear(self) -> None:
        with self._lock:
            self.count = self._folded = 0
            self._pending = []
            self._acc = None

    # --- copies: the totals travel, the lock and the owner do not ------------------------

    def _snapshot(self) -> tuple[int, int, list[Any], torch.Tensor | None]:
        with self._lock:
            _check_unmodified(self._key, self._pending, self._folded)
            acc = None if self._acc is None else self._acc.clone()
            return self.count, self._folded, list(self._pending), acc

    @classmethod
    def _restore(
        cls, key: str, owner: _Owner, state: tuple[int, int, list[Any], torch.Tensor | None]
    ) -> RunningLoss:
        entry = cls(key, owner)
        entry.count, entry._folded, pending, entry._acc = state
        entry._pending = _fresh(pending)
        return entry

    def __reduce__(self) -> Any:
        return (_rebuild_running, (self._key, self._owner.device, self._snapshot()))

    def __len__(self) -> int:
        return self.count

    def insert(self, index: int, value: Any) -> None:
        raise TypeError(
            f"LossLog[{self._key!r}] is in running mode: it keeps sum/count/min/max, not a "
            "list, so there is no position to insert at; use .append(value)"
        )

    def __getitem__(self, index: Any) -> Any:
        raise TypeError(
            f"LossLog[{self._key!r}] is in running mode: values are not kept; read .sum, "
            ".count, .min, .max or call log.reduce()"
        )

    def __setitem__(self, index: Any, value: Any) -> None:
        self.__getitem__(index)

    def __iter__(self) -> Iterator[Any]:
        self.__getitem__(0)
        return iter(())

    def __repr__(self) -> str:
        acc = self._fold()
        if acc is None:
            return "RunningLoss(count=0)"
        s, lo, hi = acc.tolist()  # repr is for humans: a host sync is fine here
        return f"RunningLoss(count={self.count}, sum={s:g}, min={lo:g}, max={hi:g})"


def _rebuild_running(
    key: str, device: torch.device | None, state: tuple[int, int, list[Any], torch.Tensor | None]
) -> RunningLoss:
    return RunningLoss._restore(key, _Owner(device), state)


def _identity(device: torch.device, dtype: torch.dtype, n: int) -> torch.Tensor:
    """``[0, +inf, -inf, 0][:n]``, made on the device (no host-to-device copy)."""
    out = torch.zeros(n, dtype=dtype, device=device)
    out[1].fill_(math.inf)
    out[2].fill_(-math.inf)
    return out


def _acc_dtype(device: torch.device) -> torch.dtype:
    # float64 keeps thousands of float32/bf16 losses exact enough; MPS has no float64.
    return torch.float32 if device.type == "mps" else torch.float64


def _check_unmodified(key: str, values: list[Any], first: int) -> None:
    """Every stored tensor had version 0 when stored: raise if one moved since."""
    for i, v in enumerate(values):
        if type(v) is not float and v._version:
            raise ValueError(
                f"LossLog[{key!r}]: the value at position {first + i} was modified in place "
                "after it was appended (its version counter moved), so the logged history "
                "is no longer what was appended. The log stores a detached alias, not a copy: "
                "append a copy of values you keep updating (append(x.clone()), e.g. a "
                "running total or a parameter before optimizer.step())."
            )


def _listed(key: str, entry: LossList) -> list[Any]:
    _check_unmodified(key, entry, 0)  # a copy must not launder a rewritten value
    return list(entry)


def _fresh(values: list[Any]) -> list[Any]:
    """Values restored from a copy, each with version 0 again (unpickling and deepcopy
    write into new storages, which moves the counter; the source was checked unmodified)."""
    return [v if type(v) is float or not v._version else v.clone() for v in values]


def _local(
    key: str, values: list[Any], device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sum, min, max)`` of stored values as 0-d tensors on ``device`` (no host sync).

    Tensors are stacked on the device; Python numbers are reduced on the host and merged
    as scalar arguments, so no host data is uploaded.
    """
    tensors = [v for v in values if type(v) is not float]
    numbers = [v for v in values if type(v) is float] if len(tensors) != len(values) else []
    if tensors:
        try:
            stacked = torch.stack(tensors)  # the common case: all 0-d
        except RuntimeError:  # mixed 0-d and 1-element shapes
            stacked = torch.stack([v.reshape(()) for v in tensors])
        if stacked.is_complex():
            raise TypeError(f"LossLog[{key!r}]: complex tensors are not losses")
        flat = stacked.reshape(-1).to(dtype)
        total, low, high = flat.sum(), flat.min(), flat.max()
        if numbers:
            total = total + math.fsum(numbers)
            low = low.clamp(max=min(numbers))
            high = high.clamp(min=max(numbers))
        return total, low, high

    def full(x: float) -> torch.Tensor:
        return torch.full((), x, dtype=dtype, device=device)

    return full(math.fsum(numbers)), full(min(numbers)), full(max(numbers))


Entry = LossList | RunningLoss


class LossLog(dict[str, Any]):
    """A ``dict[str, list[Tensor]]`` for per-microbatch losses that never holds a graph.

    Args:
        keys: the loss names, in a fixed order that must be the same on every rank (it is
            the order in which ``reduce`` packs them for collectives). A sequence of names
            (each reduced with ``"mean"``) or a mapping ``{name: "sum"|"mean"|"min"|"max"}``.
        running: keep O(1) accumulators per key instead of a list of values, for thousands
            of microbatches per step.
        device: the device of the values; by default, the device of the first tensor logged
            (forgotten again by ``clear``). All tensor values of a log must share it.

    It *is* a ``dict`` (``isinstance(log, dict)`` holds, ``log[name]`` is a plain dict
    lookup), so logging code that takes the dict keeps working: ``log[name].append(loss)``,
    ``log[name] = [...]``, ``extend``, ``insert``, ``+=``, ``keys()``, ``items()``,
    ``values()``, ``len``, iteration, ``in``, ``repr``, ``json``-style walks. Keys are fixed:
    an unknown key raises ``KeyError`` listing the declared ones, and keys cannot be removed.
    Every Python-level path that stores into it (``[]=``, ``update``, ``setdefault``, ``|=``)
    goes through validation; only C code that calls ``dict.__setitem__`` on it explicitly
    could bypass that.
    """

    def __init__(
        self,
        keys: Sequence[str] | Mapping[str, str],
        *,
        running: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        if isinstance(keys, str):
            raise TypeError(f"LossLog(keys={keys!r}): pass a list of names, e.g. [{keys!r}]")
        if isinstance(keys, Mapping):
            spec = dict(keys)
        elif isinstance(keys, Iterable):
            names = list(keys)
            spec = {k: "mean" for k in names}
            if len(spec) != len(names):
                raise ValueError(f"LossLog(keys=...): duplicate names in {names!r}")
        else:
            raise TypeError(f"LossLog(keys=...): expected names or a mapping, got {keys!r}")
        for name, op in spec.items():
            if not isinstance(name, str):
                raise TypeError(f"LossLog(keys=...): key {name!r} is not a string")
            if op not in REDUCTIONS:
                raise ValueError(
                    f"LossLog(keys=...): unknown reduction {op!r} for key {name!r}; "
                    f"choose one of {', '.join(REDUCTIONS)}"
                )
        if not spec:
            raise ValueError("LossLog(keys=...): declare at least one key")
        super().__init__()
        self._reductions: dict[str, str] = spec
        self._running = _args.flag("LossLog", "running", running)
        self._owner = _Owner(_check_device(device) if device is not None else None)
        for key in spec:
            dict.__setitem__(self, key, self._new_entry(key))

    # --- mapping -------------------------------------------------------------------------

    def _new_entry(self, key: str, values: Iterable[Any] = ()) -> Entry:
        if self._running:
            return RunningLoss(key, self._owner, values)
        return LossList(key, self._owner, values)

    def __missing__(self, key: object) -> Any:
        raise KeyError(f"{key!r} is not a declared loss; declared: {', '.join(map(repr, self))}")

    def __setitem__(self, key: str, values: Iterable[Any]) -> None:
        current = self[key]  # KeyError for an undeclared key
        if values is current:
            return  # `log[k] += [...]` assigns the same (already updated) entry back
        dict.__setitem__(self, key, self._new_entry(key, values))

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        new = dict(*args, **kwargs)
        for key in new:
            self[key]
        entries = {k: self._new_entry(k, v) for k, v in new.items()}  # all validated first
        for key, entry in entries.items():
            dict.__setitem__(self, key, entry)

    def __ior__(self, other: Any) -> LossLog:  # type: ignore[override, misc]
        self.update(other)
        return self

    def setdefault(self, key: str, default: Any = None) -> Any:
        return self[key]  # every declared key always has an entry

    def _fixed(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "LossLog keys are fixed (every rank must pack the same keys); clear one key with "
            "log[name].clear() or all of them with log.clear()"
        )

    __delitem__ = _fixed
    pop = _fixed
    popitem = _fixed

    def copy(self) -> LossLog:  # type: ignore[override]
        """An independent log with the same keys, values and totals (``copy.copy(log)``)."""
        return copy.copy(self)

    def __reduce__(self) -> Any:
        # copy.copy, copy.deepcopy and pickle all go through here: the snapshot is new
        # lists and cloned accumulators, so even a shallow copy shares no mutable state
        # (the stored tensors are shared, and immutable by contract: see reduce's check).
        state = {
            k: v._snapshot() if isinstance(v, RunningLoss) else _listed(k, v)
            for k, v in self.items()
        }
        owner = self._owner
        return (
            _rebuild,
            (self._reductions, self._running, owner.device, owner.fixed_device, state),
        )

    # --- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume mid-accumulation: plain dicts, lists, strings,
        numbers and tensors only, so ``torch.load``'s default ``weights_only=True`` reads it.

        ``{"reductions", "running", "device", "fixed_device", "values"}``; ``values[key]``
        is the list of stored values (list mode) or ``{"count", "folded", "pending",
        "acc"}`` (running mode: the unfolded values and the ``[sum, min, max]``
        accumulator, so a resumed log folds exactly as an uninterrupted one would). Stored
        tensors are shared (they are immutable by contract); the accumulator is copied.
        """
        values: dict[str, Any] = {}
        for key, entry in self.items():
            if isinstance(entry, RunningLoss):
                count, folded, pending, acc = entry._snapshot()
                values[key] = {"count": count, "folded": folded, "pending": pending, "acc": acc}
            else:
                values[key] = _listed(key, entry)
        device = self._owner.device
        return {
            "reductions": dict(self._reductions),
            "running": self._running,
            "device": None if device is None else str(device),
            "fixed_device": self._owner.fixed_device,
            "values": values,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace every key's values with those of ``state`` (:meth:`state_dict`'s).

        Raises ``ValueError`` naming what differs (a key, its reduction, the mode), and
        ``TypeError`` for a value that is not one, before anything changes. With a device
        set at construction, loaded tensors are moved there (a checkpoint loaded with
        ``map_location="cpu"`` resumes on the device); otherwise the log takes theirs.
        """
        if not isinstance(state, Mapping) or not {"reductions", "running", "values"} <= set(state):
            raise TypeError(
                "LossLog.load_state_dict(state): expected the dict LossLog.state_dict() "
                "returns, with 'reductions', 'running' and 'values'"
            )
        theirs = dict(state["reductions"])
        if theirs != self._reductions:
            differ = sorted(set(theirs) ^ set(self._reductions)) or [
                k for k in self._reductions if theirs[k] != self._reductions[k]
            ]
            raise ValueError(
                f"LossLog.load_state_dict: key {differ[0]!r} differs (this log: "
                f"{self._reductions}; the state: {theirs}); declare the same keys and "
                "reductions to resume"
            )
        if bool(state["running"]) != self._running:
            raise ValueError(
                f"LossLog.load_state_dict: the state is {'running' if state['running'] else 'list'}"
                f" mode, this log is {'running' if self._running else 'list'} mode; create the "
                "log with the same running= to resume"
            )
        owner = _Owner(self._owner.device if self._owner.fixed_device else None)
        owner.fixed_device = self._owner.fixed_device
        entries: dict[str, Entry] = {}
        for key in self._reductions:  # all validated and built before any is stored
            value = state["values"].get(key, [] if not self._running else None)
            if self._running:
                entries[key] = self._load_running(key, owner, value)
            else:
                entries[key] = LossList(key, owner, self._placed(value, owner))
        if owner.device is None and state.get("device") and any(len(e) for e in entries.values()):
            owner.device = torch.device(state["device"])
        self._owner.device, self._owner.fixed_device = owner.device, owner.fixed_device
        for key, entry in entries.items():
            entry._owner = self._owner
            dict.__setitem__(self, key, entry)

    @staticmethod
    def _placed(values: Any, owner: _Owner) -> Any:
        if owner.fixed_device and owner.device is not None and isinstance(values, list):
            return [v.to(owner.device) if isinstance(v, torch.Tensor) else v for v in values]
        return values

    def _load_running(self, key: str, owner: _Owner, value: Any) -> RunningLoss:
        if value is None:
            return RunningLoss(key, owner)
        if not isinstance(value, Mapping) or not {"count", "pending", "acc"} <= set(value):
            raise TypeError(
                f"LossLog.load_state_dict: values[{key!r}] is not a running-mode state "
                "(expected count, folded, pending and acc)"
            )
        pending = _admit_many(key, self._placed(list(value["pending"]), owner), owner)
        acc = value["acc"]
        if acc is not None:
            if not isinstance(acc, torch.Tensor) or acc.shape != (3,):
                raise TypeError(
                    f"LossLog.load_state_dict: values[{key!r}]['acc'] must be a tensor "
                    "[sum, min, max]"
                )
            device = owner.device or acc.device
            acc = acc.to(device).clone()
            if owner.device is None:
                owner.device = device
        count, folded = int(value["count"]), int(value.get("folded", value["count"]))
        if count != folded + len(pending):
            raise ValueError(
                f"LossLog.load_state_dict: values[{key!r}] counts {count} values but holds "
                f"{folded} folded and {len(pending)} pending"
            )
        return RunningLoss._restore(key, owner, (count, folded, pending, acc))

    @property
    def reductions(self) -> dict[str, str]:
        """``{key: reduction}`` in declaration order."""
        return dict(self._reductions)

    @property
    def running(self) -> bool:
        return self._running

    @property
    def device(self) -> torch.device | None:
        return self._owner.device

    def clear(self) -> None:
        """Drop every value (keys stay)."""
        for entry in self.values():
            entry.clear()
        if not self._owner.fixed_device:
            self._owner.device = None

    # --- reduce ----------------------------------------------------------------------------

    def reduce(
        self,
        groups: Iterable[Any] | None = None,
        *,
        clear: bool = True,
        timeout: float = REDUCE_TIMEOUT,
    ) -> dict[str, float]:
        """Reduce every key to a float: over microbatches, then over each process group.

        ``groups`` says which processes take part, and nothing else:

        * ``None`` (the default): the default process group, as ``group=None`` means in
          ``torch.distributed``; in a process that never initialised it, the process alone;
        * a sequence, all-reduced in order, e.g. ``(dp_group, pp_group)`` (``None`` inside
          it is the default group);
        * ``()``: this process alone, with no collective (e.g. the last pipeline stage,
          when only it reduces).

        For each key, values are reduced locally (sum / mean / min / max), then all-reduced
        over each group. Keys that share an op are packed into one tensor: at most one
        collective per op (``SUM``, ``MIN``, ``MAX``) per group, and exactly one
        device-to-host transfer for the whole call, however many keys and microbatches.
        Nothing is uploaded from host memory: identities and counts are made on the
        device, so that transfer is the call's only host sync.

        A rank with no values for a key contributes the op's identity: mean is carried as
        (sum, count), min / max as +inf / -inf, so results are unbiased. A key with no
        values on any rank reduces to ``nan`` (so every rank logs the same keys).

        Raises ``ValueError`` naming the key and position if a stored value was modified in
        place after it was appended (the number it would log is not the one appended).

        Every rank of each group must call ``reduce`` with the same keys and groups. A
        collective that does not complete within ``timeout`` seconds (default
        :data:`REDUCE_TIMEOUT`: 5 minutes), because a rank of the group never calls
        ``reduce`` (a pipeline's last stage reducing alone over the default group, the
        usual one), raises ``TimeoutError`` naming the group and that cause, instead of
        waiting for the group's own timeout (30 minutes by default) with no word of why.
        Clears the log afterwards unless ``clear=False`` (not after an error).
        """
        group_list = _group_list(groups)
        _args.flag("LossLog.reduce", "clear", clear)
        _args.seconds("LossLog.reduce", "timeout", timeout)
        keys = list(self)
        packs = self._local_packs(keys)
        if group_list:
            import torch.distributed as dist

            red = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
            for group in group_list:
                works = [
                    dist.all_reduce(pack, op=red[op], group=group, async_op=True)
                    for op, pack in packs.items()
                ]
                for work in works:
                    _bounded_wait(work, group, timeout)
        out = self._results(keys, packs)
        if clear:
            self.clear()
        return out

    def _local_packs(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """Phase 1, on the device: each key reduced over its microbatches, packed by the op
        its collective needs: ``"sum"`` holds every key's sum then every key's count, and
        ``"min"`` / ``"max"`` (present only when some key uses them) one column each."""
        device = self._owner.device or torch.device("cpu")
        dtype = _acc_dtype(device)
        # Row i: key i's [sum, min, max, count], with the op's identity in the columns that
        # are not its op (0 for sum, +inf for min, -inf for max), all made on the device.
        identity = _identity(device, dtype, 4)
        zero, pos_inf, neg_inf = identity[0], identity[1], identity[2]
        rows = []
        for key in keys:
            entry = self[key]
            op = self._reductions[key]
            count = len(entry)
            if count == 0:
                rows.append(identity)
                continue
            if isinstance(entry, RunningLoss):
                acc = entry._fold()
                if acc is None:  # only values logged and then cleared
                    rows.append(identity)
                    continue
                total, low, high = acc.to(dtype)
            else:
                _check_unmodified(key, entry, 0)
                total, low, high = _local(key, entry, device, dtype)
            rows.append(
                torch.stack(
                    (
                        total if op in ("sum", "mean") else zero,
                        low if op == "min" else pos_inf,
                        high if op == "max" else neg_inf,
                        torch.full((), float(count), dtype=dtype, device=device),
                    )
                )
            )
        ops = set(self._reductions.values())
        sums, mins, maxs, counts = torch.stack(rows).t()
        packs = {"sum": torch.cat([sums, counts])}  # cat: contiguous, as collectives need
        if "min" in ops:
            packs["min"] = mins.contiguous()
        if "max" in ops:
            packs["max"] = maxs.contiguous()
        return packs

    def _results(self, keys: list[str], packs: dict[str, torch.Tensor]) -> dict[str, float]:
        """Phase 3: the call's one device-to-host transfer, and each key's float."""
        n = len(keys)
        host = torch.cat(list(packs.values())).to("cpu", copy=True).tolist()
        columns = {"sum": host[:n], "count": host[n : 2 * n]}
        offset = 2 * n
        for op in ("min", "max"):  # each column is there exactly when some key uses its op
            if op in packs:
                columns[op] = host[offset : offset + n]
                offset += n
        out: dict[str, float] = {}
        for i, key in enumerate(keys):
            op = self._reductions[key]
            count = columns["count"][i]
            if count == 0:
                out[key] = math.nan
            elif op == "mean":
                out[key] = columns["sum"][i] / count
            else:
                out[key] = columns[op][i]
        return out


def _bounded_wait(work: Any, group: Any, timeout: float) -> None:
    """Wait for ``work`` (an all-reduce over ``group``) at most ``timeout`` seconds.

    On an accelerator the host waits for the collective here rather than at the copy of
    the results to the host that follows: still one wait per call."""
    import datetime

    import torch.distributed as dist

    try:
        work.wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        if "time" not in str(e).lower():
            raise
        if group is None:
            which = f"the default process group ({dist.get_world_size()} ranks)"
        else:
            which = f"the process group of ranks {dist.get_process_group_ranks(group)}"
        raise TimeoutError(
            f"LossLog.reduce: the all-reduce over {which} did not complete within "
            f"{timeout:g} s: a rank of that group did not call reduce(). Every rank of a "
            "group must call it; in a pipeline only the last stage has losses: reduce its "
            "log with groups=() (this stage alone), or over a group of last stages "
            "(groups=(dp_group,))"
        ) from e


def _group_list(groups: Any) -> list[Any]:
    """``groups`` as the list of groups to all-reduce over (empty: no collective); raises
    before any state changes."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    if groups is None:
        return [None] if initialized else []  # the default group; uninitialised: this process
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Iterable):
        raise TypeError(
            f"LossLog.reduce(groups={groups!r}): expected a sequence of process groups, "
            "e.g. groups=(dp_group,) or groups=(dp_group, pp_group); None (the default) is "
            "the default group, and () reduces on this process alone"
        )
    group_list = list(groups)
    if group_list and not initialized:
        raise RuntimeError(
            f"LossLog.reduce(groups={groups!r}): torch.distributed is not initialized; call "
            "dist.init_process_group first, or reduce() / reduce(groups=()) for this process"
        )
    return group_list


def _rebuild(
    reductions: dict[str, str],
    running: bool,
    device: torch.device | None,
    fixed_device: bool,
    state: dict[str, Any],
) -> LossLog:
    log = LossLog(reductions, running=running)
    owner = log._owner
    owner.device, owner.fixed_device = device, fixed_device
    for key, values in state.items():
        entry: Entry
        if running:
            entry = RunningLoss._restore(key, owner, values)
        else:
            entry = LossList._restore(key, owner, values)
        dict.__setitem__(log, key, entry)
    return log


def _check_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` that exists on this machine, or a ValueError."""
    dev = _args.device("LossLog", "device", device)
    if dev.type in ("cpu", "meta"):
        return dev
    try:
        module = device_module(dev)
        available, count = module.is_available(), module.device_count()
    except (AttributeError, RuntimeError) as e:
        raise ValueError(
            f"LossLog(device={device!r}): {dev.type} is not usable here ({e})"
        ) from None
    if not available or count == 0:
        raise ValueError(
            f"LossLog(device={device!r}): there is no {dev.type} device on this machine; "
            "leave device=None to use the device of the first value logged"
        )
    if dev.index is not None and dev.index >= count:
        raise ValueError(
            f"LossLog(device={device!r}): this machine has {count} {dev.type} device(s), "
            f"{dev.type}:0 to {dev.type}:{count - 1}"
        )
    if dev.index is None:  # "cuda" means the current device, where torch puts its tensors
        dev = torch.device(dev.type, module.current_device())
    return dev


def _allow_in_weights_only_loads() -> None:
    """Let ``torch.load``'s default (``weights_only=True``) read a pickled ``LossLog``: its
    two rebuild functions only construct a log from plain data (keys, reductions, tensors)
    and call nothing else, so they are safe to allow. Run when this module is imported,
    and by ``import leakfree`` when torch is already imported."""
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is not None:
        add([_rebuild, _rebuild_running])


_allow_in_weights_only_loads()
