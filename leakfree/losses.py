"""``LossLog``: a per-step loss-logging dict that can never hold an autograd graph.

Training loops keep per-microbatch losses for logging, usually in a
``dict[str, list[Tensor]]``. One entry appended without ``.detach()`` keeps that
microbatch's whole graph alive, with everything its custom Functions left on ``ctx``, until
the step ends: ~164 MiB per microbatch and an OOM at 128 microbatches in one real trainer.
``LossLog`` takes the detaching away from the call sites: every path into it detaches.

Lifetime contract
-----------------
*Stored*: a detached copy of each value's data (a 1-element tensor, or a Python number).
Never the graph: nothing with ``grad_fn`` or ``requires_grad`` gets in, by any path. A value
that is a view of a larger tensor is cloned, so logging ``per_sample[0]`` does not pin
``per_sample``'s storage.
*Released*: everything, by :meth:`LossLog.reduce` (unless ``clear=False``) or
:meth:`LossLog.clear`.
*Running mode*: only O(1) accumulators per key (sum, count, min, max) on the values'
device; the appended tensors are not kept at all.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, SupportsIndex, TypeVar, overload

import torch

__all__ = ["REDUCTIONS", "LossList", "LossLog", "RunningLoss", "detach_tree"]

Reduction = Literal["sum", "mean", "min", "max"]
REDUCTIONS: tuple[str, ...] = ("sum", "mean", "min", "max")
Value = torch.Tensor | float | int

_IDENTITY = {"min": math.inf, "max": -math.inf}


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
        if value._base is not None:
            # A view of a bigger tensor: its whole storage would stay pinned by the log.
            stored = stored.clone()
        return stored
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"LossLog[{key!r}]: expected a 1-element tensor or a Python number, "
            f"got {type(value).__name__}"
        )
    return float(value)


def _admit(key: str, value: Any, owner: _Owner) -> Any:
    """What to store for one value (validated), making its device the log's if unset."""
    if _plain_scalar(value, owner):  # the per-microbatch fast path
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


def _plain_scalar(value: Any, owner: _Owner) -> bool:
    """The per-microbatch fast path: a 0-d, non-view, real tensor on the log's device,
    which ``_check`` would accept and store as ``value.detach()``."""
    return (
        type(value) is torch.Tensor
        and not value.dim()
        and value._base is None
        and value.device == owner.device
        and not value.is_complex()
    )


_list_append = list.append


class LossList(list[Any]):
    """The list behind ``log[name]`` in list mode: every entry path stores detached values.

    ``append``, ``extend``, ``insert``, ``+=``, ``lst[i] = v`` and ``lst[a:b] = [...]`` all
    validate first (nothing is stored when one value is bad), then store detached values.
    Reading, removing and reordering behave as for a plain list.
    """

    __slots__ = ("_key", "_owner")

    def __init__(self, key: str, owner: _Owner, values: Iterable[Any] = ()) -> None:
        self._key = key
        self._owner = owner
        super().__init__(_admit_many(key, values, owner))

    def append(self, value: Any) -> None:
        _list_append(self, _admit(self._key, value, self._owner))

    def extend(self, values: Iterable[Any]) -> None:
        super().extend(_admit_many(self._key, values, self._owner))

    def insert(self, index: SupportsIndex, value: Any) -> None:
        super().insert(index, _admit(self._key, value, self._owner))

    def __iadd__(self, values: Iterable[Any]) -> LossList:  # type: ignore[override, misc]
        self.extend(values)
        return self

    @overload
    def __setitem__(self, index: SupportsIndex, value: Any) -> None: ...
    @overload
    def __setitem__(self, index: slice, value: Iterable[Any]) -> None: ...
    def __setitem__(self, index: Any, value: Any) -> None:
        if isinstance(index, slice):
            super().__setitem__(index, _admit_many(self._key, value, self._owner))
        else:
            super().__setitem__(index, _admit(self._key, value, self._owner))

    def copy(self) -> list[Any]:  # a plain list of the (already detached) values
        return list(self)

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        return (list, (list(self),))  # pickles/copies as a plain list


class RunningLoss:
    """The O(1) accumulator behind ``log[name]`` in running mode.

    Keeps ``sum``, ``min`` and ``max`` as tensors on the values' device (updated without
    any host sync) and ``count`` as a Python int. Appended values are folded into the
    accumulators in batches of at most ``FOLD`` (one stack and three reductions per batch,
    instead of kernels per value), so at most ``FOLD`` detached scalars are held at once.
    ``append``, ``extend``, ``+=`` and ``log[name] = [...]`` add values; order-dependent
    list operations (``insert``, indexing) raise ``TypeError``.
    """

    FOLD = 64

    __slots__ = ("_acc", "_key", "_owner", "_pending", "count")

    def __init__(self, key: str, owner: _Owner, values: Iterable[Any] = ()) -> None:
        self._key = key
        self._owner = owner
        self.count = 0
        self._pending: list[Any] = []
        self._acc: torch.Tensor | None = None  # [sum, min, max] in the accumulation dtype
        self.extend(values)

    def append(self, value: Any) -> None:
        self._pending.append(_admit(self._key, value, self._owner))
        self.count += 1
        if len(self._pending) >= self.FOLD:
            self._fold()

    def extend(self, values: Iterable[Any]) -> None:
        items = _admit_many(self._key, values, self._owner)
        self._pending.extend(items)
        self.count += len(items)
        if len(self._pending) >= self.FOLD:
            self._fold()

    def __iadd__(self, values: Iterable[Any]) -> RunningLoss:
        self.extend(values)
        return self

    def _fold(self) -> torch.Tensor | None:
        """Fold pending values into the accumulators; return ``[sum, min, max]``."""
        if self._pending:
            device = self._owner.device or torch.device("cpu")
            if self._acc is None:
                self._acc = _identity3(device)
            values = _stack(self._pending, device, self._acc.dtype)
            self._pending = []
            acc = self._acc
            acc[0].add_(values.sum())
            torch.minimum(acc[1], values.min(), out=acc[1])
            torch.maximum(acc[2], values.max(), out=acc[2])
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
        self.count = 0
        self._pending = []
        self._acc = None

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


def _identity3(device: torch.device) -> torch.Tensor:
    return torch.tensor([0.0, math.inf, -math.inf], dtype=_acc_dtype(device), device=device)


def _acc_dtype(device: torch.device) -> torch.dtype:
    # float64 keeps thousands of float32/bf16 losses exact enough; MPS has no float64.
    return torch.float32 if device.type == "mps" else torch.float64


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
        self._running = bool(running)
        self._owner = _Owner(torch.device(device) if device is not None else None)
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

    def copy(self) -> dict[str, Any]:  # type: ignore[override]
        """A plain dict of plain lists (list mode) / the accumulators (running mode)."""
        return {k: (list(v) if isinstance(v, LossList) else v) for k, v in self.items()}

    def __reduce__(self) -> Any:
        return (_rebuild, (self._reductions, self._running, self.copy()))

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

    def reduce(self, groups: Iterable[Any] = (), *, clear: bool = True) -> dict[str, float]:
        """Reduce every key to a float: over microbatches, then over each process group.

        For each key, values are reduced locally (sum / mean / min / max), then all-reduced
        over each group in ``groups`` in order (e.g. ``(dp_group, pp_group)``; ``None``
        means the default group). Keys that share an op are packed into one tensor: at
        most one collective per op (``SUM``, ``MIN``, ``MAX``) per group, and exactly one
        device-to-host transfer for the whole call, however many keys and microbatches.

        A rank with no values for a key contributes the op's identity: mean is carried as
        (sum, count), min / max as +inf / -inf, so results are unbiased. A key with no
        values on any rank reduces to ``nan`` (so every rank logs the same keys).

        Every rank of each group must call ``reduce`` with the same keys and groups.
        Clears the log afterwards unless ``clear=False``.
        """
        group_list = list(groups)
        if group_list:
            import torch.distributed as dist

            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError(
                    "LossLog.reduce(groups=...): torch.distributed is not initialized; "
                    "call dist.init_process_group first, or reduce() without groups"
                )
        device = self._owner.device or torch.device("cpu")
        dtype = _acc_dtype(device)
        keys = list(self)
        n = len(keys)
        # Local reduction, on device. Row i of [sum, min, max] holds key i's contribution,
        # with the op's identity where the key has no values or is not that op.
        identity = _identity3(device).to(dtype)
        rows = []
        counts = []
        for key in keys:
            entry = self[key]
            counts.append(float(len(entry)))
            if len(entry) == 0:
                rows.append(identity)
            elif isinstance(entry, RunningLoss):
                acc = entry._fold()
                assert acc is not None
                rows.append(acc.to(dtype))
            else:
                values = _stack(entry, device, dtype)
                rows.append(torch.stack((values.sum(), values.min(), values.max())))
        ops = [self._reductions[k] for k in keys]
        mask = torch.tensor(
            [[op in ("sum", "mean"), op == "min", op == "max"] for op in ops], device=device
        )
        table = torch.where(mask, torch.stack(rows), identity)  # (n, 3)
        sums, mins, maxs = table.t().contiguous()  # collectives need contiguous packs
        # Python ints -> device: a host-to-device copy, never a device-to-host sync.
        count_t = torch.tensor(counts, dtype=dtype, device=device)
        packs = {"sum": torch.cat([sums, count_t])}
        if "min" in ops:
            packs["min"] = mins
        if "max" in ops:
            packs["max"] = maxs
        if group_list:
            import torch.distributed as dist

            red = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
            for group in group_list:
                for op, pack in packs.items():
                    dist.all_reduce(pack, op=red[op], group=group)
        flat = torch.cat(list(packs.values()))
        host = flat.to("cpu", copy=True).tolist()  # the one device-to-host transfer
        total, count_list = host[:n], host[n : 2 * n]
        offset = 2 * n
        min_list = host[offset : offset + n] if "min" in packs else None
        offset += n if "min" in packs else 0
        max_list = host[offset : offset + n] if "max" in packs else None
        out: dict[str, float] = {}
        for i, key in enumerate(keys):
            op = self._reductions[key]
            c = count_list[i]
            if c == 0:
                out[key] = math.nan
            elif op == "sum":
                out[key] = total[i]
            elif op == "mean":
                out[key] = total[i] / c
            elif op == "min":
                assert min_list is not None
                out[key] = min_list[i]
            else:
                assert max_list is not None
                out[key] = max_list[i]
        if clear:
            self.clear()
        return out


def _rebuild(reductions: dict[str, str], running: bool, values: dict[str, Any]) -> LossLog:
    log = LossLog(reductions, running=running)
    if not running:
        log.update(values)
    return log


def _stack(values: list[Any], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The values as one 1-D tensor of ``dtype`` on ``device`` (no host sync)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    parts = []
    if tensors:
        try:
            stacked = torch.stack(tensors)  # the common case: all 0-d
        except RuntimeError:  # mixed 0-d and 1-element shapes
            stacked = torch.stack([v.reshape(()) for v in tensors])
        parts.append(stacked.reshape(-1).to(dtype))
    if len(tensors) != len(values):
        numbers = [v for v in values if not isinstance(v, torch.Tensor)]
        parts.append(torch.tensor(numbers, dtype=dtype, device=device))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# --- detach_tree ------------------------------------------------------------------------------

T = TypeVar("T")


def detach_tree(obj: T) -> T:
    """Return ``obj`` with every tensor inside it detached, for outputs handed to logging.

    Walks dicts (and other mappings that can be rebuilt from pairs), lists, tuples,
    namedtuples, sets and dataclass instances, rebuilding each container with the same type;
    anything else is returned as is. The detached tensors share storage with the originals
    (no copy), but carry no ``grad_fn``: holding them never keeps a graph alive.
    """
    return _detach(obj, {})  # type: ignore[no-any-return]


def _detach(obj: Any, memo: dict[int, Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    key = id(obj)
    if key in memo:
        return memo[key]
    result: Any
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        result = type(obj)(*(_detach(v, memo) for v in obj))
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = [_detach(v, memo) for v in obj]
        result = items if type(obj) is list else type(obj)(items)
    elif isinstance(obj, Mapping):
        pairs = [(k, _detach(v, memo)) for k, v in obj.items()]
        result = dict(pairs) if type(obj) is dict else type(obj)(pairs)  # type: ignore[call-arg]
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: _detach(getattr(obj, f.name), memo) for f in dataclasses.fields(obj) if f.init
        }
        result = dataclasses.replace(obj, **changes)
        for f in dataclasses.fields(obj):
            if not f.init and hasattr(obj, f.name):
                object.__setattr__(result, f.name, _detach(getattr(obj, f.name), memo))
    else:
        return obj
    memo[key] = result
    return result
