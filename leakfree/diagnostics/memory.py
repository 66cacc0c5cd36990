"""Live bytes per device per step, and how fast they grow.

:class:`MemoryTracker` samples, at every ``tracker.step()``, the bytes alive on each device:

* on an accelerator, from the allocator (``torch.cuda.memory_allocated`` and its
  equivalents through ``torch.get_device_module``);
* on any device (and always on CPU), from the tensor storages created while the tracker is
  active: a ``TorchDispatchMode`` records each new storage with a weak reference, so a
  storage counts exactly as long as something holds it, a C++ autograd node included.

``growth()`` fits bytes against step by least squares and returns the slope with a noise
bound (three standard errors of the slope, and never less than the residual spread over
the run), so "grows by 1.0 MiB per step +- 2 KiB" separates a leak from noise.

Cost. The storage tracker is a Python dispatch mode: every aten op of a tracked step goes
through Python (about 2x the step time of a small model of many small ops; that is the
mode itself, an empty dispatch mode costs nearly as much). So it runs only where it is
needed (no device read from an allocator) and, with ``sample_every=k``, only during about
one step in ``k`` (randomly spaced, so a leak every other step is not aliased away). A
sampled series holds one value per tracked step: the bytes still alive of the storages
created during tracked steps. Each tracked step adds what it left behind, so the slope
over the samples is still bytes per step.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from leakfree._device import accelerator, device_index, device_module
from leakfree._text import format_bytes, format_table

__all__ = ["Growth", "MemoryTracker", "StorageTracker", "fit_growth"]


@dataclass(frozen=True)
class Growth:
    """Least-squares growth of live bytes per step."""

    bytes_per_step: float
    noise: float  #: bound on what noise alone could produce (bytes per step)
    steps: int  #: samples used
    first: int  #: live bytes at the first sample used
    last: int  #: live bytes at the last sample
    halves: tuple[float, float] = (0.0, 0.0)  #: slopes over the first and the second half

    def exceeds(self, tolerance: float = 0.0) -> bool:
        """Growth beyond ``tolerance`` bytes per step that noise cannot explain, and that
        persists: both halves of the run grow too (a one-off jump, e.g. optimizer state
        created mid-run, is not a leak)."""
        return self.bytes_per_step - self.noise > tolerance and min(self.halves) > tolerance

    def __str__(self) -> str:
        return f"{format_bytes(self.bytes_per_step)}/step +- {format_bytes(self.noise)}"


def fit_growth(values: Sequence[float]) -> Growth:
    """Slope of ``values`` against their index, with a noise bound (see module doc)."""
    n = len(values)
    if n < 2:
        v = int(values[0]) if values else 0
        return Growth(0.0, math.inf, n, v, v)
    xs = range(n)
    mean_x = (n - 1) / 2
    mean_y = sum(values) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, values)) / sxx
    residuals = [y - (mean_y + slope * (x - mean_x)) for x, y in zip(xs, values)]
    if n > 2:
        sigma = math.sqrt(sum(r * r for r in residuals) / (n - 2))
        stderr = sigma / math.sqrt(sxx)
        spread = (max(residuals) - min(residuals)) / (n - 1)
        noise = max(3 * stderr, spread)
    else:
        noise = 0.0
    half = n // 2
    halves = (_slope(values[: half + 1]), _slope(values[half:])) if n >= 4 else (slope, slope)
    return Growth(slope, noise, n, int(values[0]), int(values[-1]), halves)


def _slope(values: Sequence[float]) -> float:
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    sxx = sum((x - mean_x) ** 2 for x in range(n))
    return sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values)) / sxx


class StorageTracker(TorchDispatchMode):
    """Records every storage created by an aten op while active; counts those still alive.

    A storage is counted, with its current size, for as long as anything (Python or C++)
    holds it. Storages that existed before activation are not counted, even when an op
    returns a view of them or writes into them. Not seen: tensors that never pass through
    an aten op (``torch.from_numpy``, ``torch.frombuffer``, a DataLoader's pinned batches)
    and non-strided (sparse, nested) tensors.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._live: dict[int, tuple[StorageWeakRef, int, str]] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        kind = _KINDS.get(func)
        if kind is None:
            kind = _KINDS[func] = _kind(func)
        if kind == _VIEW:
            return out  # a view of an input's storage: nothing new
        # Hot path: runs for every aten op while tracking.
        outputs = out if type(out) in (tuple, list) else (out,)
        live = self._live
        inputs: set[int] | None = None
        for t in outputs:
            if not isinstance(t, torch.Tensor):
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse, nested: not tracked
                continue
            key = storage._cdata
            seen = live.get(key)
            if seen is not None and not seen[0].expired():  # type: ignore[no-untyped-call]
                continue
            if kind == _MUTATES:  # in-place and out= ops return an input's storage
                if inputs is None:
                    inputs = _storages_of(args, kwargs)
                if key in inputs:
                    continue
            live[key] = (
                StorageWeakRef(storage),  # type: ignore[no-untyped-call]
                storage.nbytes(),
                str(t.device),  # meta tensors land under "meta", which no one samples
            )
        return out

    def live_bytes(self) -> dict[str, int]:
        """Bytes of tracked storages still alive, per device (and forgets the dead ones).

        Sizes are read now, so a storage resized since (grown, or freed with ``resize_(0)``
        as ``release_output`` does) counts with its current size.
        """
        out: dict[str, int] = {}
        dead = []
        for key, (ref, nbytes, device) in self._live.items():
            if ref.expired():  # type: ignore[no-untyped-call]
                dead.append(key)
            else:
                nbytes = _current_nbytes(ref, nbytes)
                out[device] = out.get(device, 0) + nbytes
        for key in dead:
            del self._live[key]
        return out


_LIFT_FRESH = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}
_VIEW, _NEW, _MUTATES = 0, 1, 2
_KINDS: dict[Any, int] = {}


def _kind(func: Any) -> int:
    """What an op's outputs are: views of inputs, new storages, or maybe an input's.

    torch.tensor(data) builds its storage below the dispatcher and only "lifts" it (an op
    marked as a view): that output is new although it is an input's storage.
    """
    if func in _LIFT_FRESH:
        return _NEW
    if func.is_view:
        return _VIEW
    schema = getattr(func, "_schema", None)
    return _MUTATES if schema is None or schema.is_mutable else _NEW


_from_weak = getattr(torch.UntypedStorage, "_new_with_weak_ptr", None)


def _current_nbytes(ref: StorageWeakRef, recorded: int) -> int:
    if _from_weak is None:
        return recorded
    try:
        return int(_from_weak(ref.cdata).nbytes())
    except RuntimeError:  # expired between the check and now
        return 0


def _storages_of(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> set[int]:
    found: set[int] = set()
    for value in (*args, *(kwargs or {}).values()):
        items = value if isinstance(value, (tuple, list)) else (value,)
        for t in items:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                found.add(t.untyped_storage()._cdata)
    return found


def _default_devices() -> list[torch.device]:
    devices = [torch.device("cpu")]
    acc = accelerator()
    if acc is not None:
        devices.append(torch.device(acc.type, device_index(acc)))
    return devices


@dataclass
class MemoryTracker:
    """Live bytes per device at each ``step()``; ``growth()`` and ``report()`` read them.

    Use as a context manager around the steps (storage tracking is active inside it)::

        tracker = MemoryTracker()
        with tracker:
            for batch in batches:
                train_step(batch)
                tracker.step()
        print(tracker.report())

    Args:
        devices: devices to sample (default: the CPU and the current accelerator).
        use_allocator: read accelerator devices from their allocator (default True); with
            False, or where a device has no allocator statistics, the storage tracker counts.
        sample_every: track storages during about one step in this many (1: every step,
            exact). Devices read from an allocator are read at every step regardless.
            Sampling needs ``step()`` called on the thread that entered the tracker, and no
            other dispatch mode entered inside it still active at ``step()``; otherwise
            every step is tracked.
        seed: seeds the random spacing of sampled steps (reproducible runs).

    ``series[device]`` holds the values, ``steps[device]`` the step index of each (0 is
    the step that ends at the first ``step()``).
    """

    devices: list[torch.device] = field(default_factory=_default_devices)
    use_allocator: bool = True
    series: dict[str, list[int]] = field(default_factory=dict)
    sample_every: int = 1
    seed: int = 0
    steps: dict[str, list[int]] = field(default_factory=dict)
    _storages: StorageTracker | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (
            isinstance(self.sample_every, bool)
            or not isinstance(self.sample_every, int)
            or self.sample_every < 1
        ):
            raise ValueError(
                f"MemoryTracker(sample_every={self.sample_every!r}): expected an int >= 1"
            )
        self.devices = [torch.device(d) for d in self.devices]
        for d in self.devices:
            self.series.setdefault(str(d), [])
            self.steps.setdefault(str(d), [])
        self._step = 0
        self._next = 0  #: the next step index to track
        self._rng = random.Random(self.seed)
        self._tracking = False  #: the storage tracker is on the dispatch stack now
        self._depth = 0  #: dispatch stack depth outside the tracker

    def _counted(self, device: torch.device) -> bool:
        """Is ``device`` counted by the storage tracker (no allocator statistics)?"""
        return self._allocator_bytes(device) is None

    def __enter__(self) -> MemoryTracker:
        self._storages = None  # on an allocator's count alone, no op pays for tracking
        if any(self._counted(d) for d in self.devices):
            self._storages = StorageTracker()
            self._depth = torch._C._len_torch_dispatch_stack()
            self._storages.__enter__()  # type: ignore[no-untyped-call]
            self._tracking = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._storages is not None and self._tracking:
            self._tracking = False
            self._storages.__exit__(*exc)  # type: ignore[no-untyped-call]

    def _allocator_bytes(self, device: torch.device) -> int | None:
        if not self.use_allocator or device.type in ("cpu", "meta"):
            return None
        allocated = getattr(device_module(device), "memory_allocated", None)
        return int(allocated(device)) if allocated is not None else None

    def sample(self) -> dict[str, int]:
        """Live bytes per device now (without recording a step)."""
        tracked = self._storages.live_bytes() if self._storages is not None else {}
        out = {}
        for device in self.devices:
            key = str(device)
            allocator = self._allocator_bytes(device)
            if allocator is not None:
                out[key] = allocator
            elif device.index is not None or device.type == "cpu":
                out[key] = tracked.get(key, 0)
            else:  # "cuda" without an index: every device of that type
                out[key] = sum(v for k, v in tracked.items() if k.split(":")[0] == device.type)
        return out

    def step(self) -> dict[str, int]:
        """Record the live bytes of each device as one step; returns what was recorded
        (devices counted by storages only when this step was tracked)."""
        index = self._step
        self._step += 1
        tracked = self._tracking or self._storages is None
        now = {
            key: value
            for key, value in self.sample().items()
            if tracked or not self._counted(torch.device(key))
        }
        for key, value in now.items():
            self.series.setdefault(key, []).append(value)
            self.steps.setdefault(key, []).append(index)
        if self._storages is not None and self.sample_every > 1:
            if index + 1 > self._next:  # draw the next tracked step: gaps average k
                self._next = index + self._rng.randint(1, 2 * self.sample_every - 1)
            self._track(index + 1 == self._next)
        return now

    def _track(self, on: bool) -> None:
        """Put the storage tracker on or off the dispatch stack, where that is safe: only
        at the depth where it was entered, never under or over another mode."""
        storages = self._storages
        if storages is None or on == self._tracking:
            return
        depth = torch._C._len_torch_dispatch_stack()
        if on and depth == self._depth:
            storages.__enter__()  # type: ignore[no-untyped-call]
            self._tracking = True
        elif not on and depth == self._depth + 1 and _get_current_dispatch_mode() is storages:
            storages.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            self._tracking = False

    def growth(self, device: str | torch.device | None = None, *, skip: int = 1) -> Growth:
        """Bytes per step on ``device`` (default: the accelerator if tracked, else the CPU),
        ignoring the first ``skip`` steps (warm-up: caches, optimizer state)."""
        key = self._key(device)
        return fit_growth(self._after(key, skip))

    def _after(self, key: str, skip: int) -> list[int]:
        return [v for v, i in zip(self.series[key], self.steps[key]) if i >= skip]

    def _key(self, device: str | torch.device | None) -> str:
        if device is None:
            keys = list(self.series)
            accelerated = [k for k in keys if not k.startswith("cpu")]
            return accelerated[0] if accelerated else keys[0]
        key = str(torch.device(device))
        if key not in self.series:
            raise KeyError(f"device {key!r} is not tracked; tracked: {', '.join(self.series)}")
        return key

    def report(self, *, skip: int = 1) -> str:
        """A table: per device, steps, first and last live bytes, growth per step."""
        rows = []
        for key, values in self.series.items():
            if not values:
                continue
            g = fit_growth(self._after(key, skip))
            verdict = "" if not g.exceeds() else "  <- grows"
            count = str(len(values))
            if len(values) < self._step:
                count = f"{len(values)} of {self._step}"
            rows.append(
                (
                    key,
                    count,
                    format_bytes(values[0]),
                    format_bytes(values[-1]),
                    f"{g}{verdict}",
                )
            )
        return format_table(("device", "steps", "first", "last", "growth per step"), rows)
