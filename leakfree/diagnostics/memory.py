"""Live bytes per device per step, and how fast they grow.

:class:`MemoryTracker` samples, at every ``tracker.step()``, the bytes alive on each device:

* on an accelerator, from the allocator (``torch.cuda.memory_allocated`` and its
  equivalents through ``torch.get_device_module``);
* on any device (and always on CPU), from the tensor storages created while the tracker is
  active: a ``TorchDispatchMode`` records each new storage with a weak reference, so a
  storage counts exactly as long as something holds it, a C++ autograd node included.

It also samples after every backward pass (microbatches), records where each tracked
storage was created, and hands both series to its detector
(:mod:`~leakfree.diagnostics.detector`), which reports leaks as it finds them.

``growth()`` fits bytes against step (a Theil-Sen slope, robust to a bounded fill) and
returns the slope with a noise bound (three standard errors of the slope, from the median
absolute residual), so "grows by 1.0 MiB per step +- 2 KiB" separates a leak from noise.

Cost. The storage tracker is a Python dispatch mode: every aten op of a tracked step goes
through Python (about 2x the step time of a small model of many small ops; that is the
mode itself, an empty dispatch mode costs nearly as much). So it runs only where it is
needed (no device read from an allocator) and, with ``sample_every=k`` (8 by default),
only during about one step in ``k`` (the first always, then randomly spaced, so a leak
every other step is not aliased away). Every step is judged all the same: on the CPU the C
heap's count (:mod:`~leakfree.diagnostics.heap`, microseconds) is read at every step and
backward, and while the detector confirms growth it suspected there, every step is
tracked; without a heap count, every step is tracked until the run is judged clean. A
sampled series holds one value per tracked step: the bytes still alive of the storages
created during tracked steps. Each tracked step adds what it left behind, so the slope
over the samples is still bytes per step.
"""

from __future__ import annotations

import random
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, ClassVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

import leakfree._args as _args
from leakfree._device import accelerator, device_index, device_module
from leakfree._text import format_bytes, format_table
from leakfree.diagnostics.boundaries import on_backward
from leakfree.diagnostics.cache import AllocatorGrowth, CacheVerdict
from leakfree.diagnostics.detector import Detector, Finding, Rule, whole
from leakfree.diagnostics.growth import Growth, fit_growth
from leakfree.diagnostics.heap import heap_counter
from leakfree.diagnostics.sites import WATCHING, Raw, Site, active_site, capture, site_of
from leakfree.errors import MemoryGrowthWarning

__all__ = ["MemoryTracker", "StorageTracker", "active_site", "weak_method"]


class StorageTracker(TorchDispatchMode):
    """Records every storage created by an aten op while active; counts those still alive.

    A storage is counted, with its current size, for as long as anything (Python or C++)
    holds it. Storages that existed before activation are not counted, even when an op
    returns a view of them or writes into them. Not seen: tensors that never pass through
    an aten op (``torch.from_numpy``, ``torch.frombuffer``, a DataLoader's pinned batches)
    and non-strided (sparse, nested) tensors.
    """

    def __init__(self, *, sites: bool = False) -> None:
        _args.flag("StorageTracker", "sites", sites)
        super().__init__()  # type: ignore[no-untyped-call]
        #: storage key -> (weak reference, bytes when made, device name, epoch when made)
        self._live: dict[int, tuple[StorageWeakRef, int, str, int]] = {}
        self.epoch = 0  #: a label for the storages made from now on (the tracker's step)
        self.created = 0  #: bytes of every storage recorded so far (what was allocated)
        #: where each tracked storage was created (with ``sites=True``): see sites.py
        self._sites: dict[int, Raw | None] | None = {} if sites else None

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
        where: Raw | bool | None = False  # captured once per op, on its first new storage
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
                if kind == _MUTATES and self._sites is not None:
                    # Written in place (``total += loss``, ``out=``): what it holds now was
                    # made here, not where its buffer was allocated.
                    if where is False:
                        where = capture(sys._getframe(1))
                    self._sites[key] = where  # type: ignore[assignment]
                continue
            if kind == _MUTATES:  # in-place and out= ops return an input's storage
                if inputs is None:
                    inputs = _storages_of(args, kwargs)
                if key in inputs:
                    continue
            device = t.device
            name = _DEVICE_NAMES.get(device)
            if name is None:  # meta tensors land under "meta", which no one samples
                name = _DEVICE_NAMES[device] = str(device)
            nbytes = storage.nbytes()
            self.created += nbytes
            live[key] = (
                StorageWeakRef(storage),  # type: ignore[no-untyped-call]
                nbytes,
                name,
                self.epoch,
            )
            if self._sites is not None:
                if where is False:
                    where = capture(sys._getframe(1))
                self._sites[key] = where  # type: ignore[assignment]
        return out

    def site(self, tensor: torch.Tensor) -> Site | None:
        """Where ``tensor``'s storage was created, if this tracker saw it made (and records
        sites); None otherwise."""
        if self._sites is None or tensor.layout != torch.strided:
            return None
        try:
            key = tensor.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return None
        seen = self._live.get(key)
        if seen is None or seen[0].expired():  # type: ignore[no-untyped-call]
            return None  # a storage at a recycled address: not the one recorded
        return site_of(self._sites.get(key))

    def tracks(self, tensor: torch.Tensor) -> bool:
        """Was ``tensor``'s storage created while this tracker was active?"""
        try:
            seen = self._live.get(tensor.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            return False
        return seen is not None and not seen[0].expired()  # type: ignore[no-untyped-call]

    def alive_by_site(self, since: int) -> list[tuple[str, int, int]]:
        """``(site, storages, bytes)`` of the storages made at epoch ``since`` or later and
        still alive, grouped by where they were made, most bytes first: what grew, by the
        line that made it, even where no walk can reach its holder (C++)."""
        groups: dict[str, list[int]] = {}
        for key, (ref, nbytes, _, epoch) in list(self._live.items()):
            if epoch < since or ref.expired():  # type: ignore[no-untyped-call]
                continue
            site = site_of(self._sites.get(key)) if self._sites is not None else None
            row = groups.setdefault(str(site) if site is not None else "?", [0, 0])
            row[0] += 1
            row[1] += _current_nbytes(ref, nbytes)
        return sorted(((s, n, b) for s, (n, b) in groups.items()), key=lambda r: -r[2])

    def live_bytes(self) -> dict[str, int]:
        """Bytes of tracked storages still alive, per device (and forgets the dead ones).

        Sizes are read now, so a storage resized since (grown, or freed with ``resize_(0)``
        as ``release_output`` does) counts with its current size.
        """
        out: dict[str, int] = {}
        dead = []
        for key, (ref, nbytes, device, _) in list(self._live.items()):  # ops may add
            if ref.expired():  # type: ignore[no-untyped-call]
                dead.append(key)
            else:
                nbytes = _current_nbytes(ref, nbytes)
                out[device] = out.get(device, 0) + nbytes
        for key in dead:
            del self._live[key]
            if self._sites is not None:
                self._sites.pop(key, None)
        return out


def weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (bound) called through a weak reference to its object: a no-op once the
    object is gone. For callbacks that must not keep their owner alive."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return call


_DEVICE_NAMES: dict[torch.device, str] = {}
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


def default_devices() -> list[torch.device]:
    devices = [torch.device("cpu")]
    acc = accelerator()
    if acc is not None:
        devices.append(torch.device(acc.type, device_index(acc)))
    return devices


@dataclass
class MemoryTracker:
    """Live bytes per device at each ``step()`` and after each backward pass; leaks found
    in them, with their holders and the lines that created them.

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
        sample_every: track storages during about one step in this many (default 8: about
            1.1x the step time of a small model instead of 2.5x; 1: every step, exact).
            The first step is always tracked, and every step while growth the heap's count
            suspected is confirmed. Devices read from an allocator are read at every step
            regardless. Sampling needs ``step()`` called on the thread that
            entered the tracker, and no other dispatch mode entered inside it still active
            at ``step()``; otherwise every step is tracked.
        seed: seeds the random spacing of sampled steps (reproducible runs).
        rule: what counts as a leak (:class:`~leakfree.diagnostics.detector.Rule`:
            warm-up, window, tolerance, floor).
        roots: objects to search for holders besides module globals and the stack,
            ``{name: object}`` or a callable returning one.
        microbatches: sample after every backward pass too, and judge what builds up
            within a step (default True).
        sites: record where each tracked storage was created (default True).
        warn: warn :class:`~leakfree.MemoryGrowthWarning` for each finding as it is made
            (default True; findings are in :attr:`findings` either way).
        on_finding: also called with each finding as it is made (a watcher's handler).
        owner: the name findings start with (default ``"MemoryTracker"``).
        unit: what a step is called in messages (default ``"steps"``).

    ``series[device]`` holds the values, ``steps[device]`` the step index of each (0 is
    the step that ends at the first ``step()``); ``findings`` the leaks found so far. A
    series holds at most :attr:`MAX_POINTS` values, so a tracker kept for a whole run
    stays the same size: once full, every other value is dropped (the first kept) and
    from then on one recorded value in twice as many is kept, so the values stay evenly
    spread over the run; the last step's is always ``series[device][-1]``.
    """

    #: the most values a device's series holds
    MAX_POINTS: ClassVar[int] = 256

    devices: list[torch.device] = field(default_factory=default_devices)
    use_allocator: bool = True
    series: dict[str, list[int]] = field(default_factory=dict)
    sample_every: int = 8
    seed: int = 0
    steps: dict[str, list[int]] = field(default_factory=dict)
    rule: Rule | None = None
    roots: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None
    microbatches: bool = True
    sites: bool = True
    warn: bool = True
    on_finding: Callable[[Finding], None] | None = None
    owner: str = "MemoryTracker"
    unit: str = "steps"
    _storages: StorageTracker | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        call = "MemoryTracker"
        whole(call, "sample_every", self.sample_every, 1)
        _args.count(call, "seed", self.seed)
        for name in ("use_allocator", "microbatches", "sites", "warn"):
            _args.flag(call, name, getattr(self, name))
        _args.function(call, "on_finding", self.on_finding, none=True)
        _args.text(call, "owner", self.owner)
        _args.text(call, "unit", self.unit)
        rule = Rule() if self.rule is None else self.rule
        if not isinstance(rule, Rule):
            raise _args.refuse(call, "rule", rule, "a leakfree.diagnostics.Rule")
        if not (self.roots is None or isinstance(self.roots, Mapping) or callable(self.roots)):
            raise _args.refuse(
                call, "roots", self.roots, "None, a {name: object} mapping or a callable"
            )
        devices = _args.items(call, "devices", self.devices, (torch.device, str), "devices")
        try:
            self.devices = [torch.device(d) for d in devices]
        except RuntimeError:
            raise _args.refuse(call, "devices", self.devices, "devices or device names") from None
        for d in self.devices:
            self.series.setdefault(str(d), [])
            self.steps.setdefault(str(d), [])
        #: per accelerator read from its allocator: what it allocates and reserves, step
        #: after step, to tell a leak from the allocator's cache (:meth:`allocator_verdicts`)
        self.allocators: dict[str, AllocatorGrowth] = {}
        for d in self.devices:
            if self.use_allocator and d.type not in ("cpu", "meta"):
                growth = AllocatorGrowth(d)
                if growth.available:
                    self.allocators[str(d)] = growth
        self._warmup = rule.warmup
        self._step = 0
        self._next = 0  #: the next step index to track
        self._rng = random.Random(self.seed)
        self._tracking = False  #: the storage tracker is on the dispatch stack now
        self._depth = 0  #: dispatch stack depth outside the tracker
        self._backward: Any = None  #: the backward-boundary handle while entered
        self._thread = 0  #: the thread that entered: its backward passes are the microbatches
        self._heap: Callable[[], int] | None = None  #: the CPU's cheap count, while entered
        #: per device: values recorded, one in how many of them its series keeps, and the
        #: number of each value kept (growth is per value recorded: a value of the storage
        #: tracker's counts only what its tracked steps made)
        self._recorded: dict[str, int] = {}
        self._stride: dict[str, int] = {}
        self._numbers: dict[str, list[int]] = {}
        # The detector holds the tracker weakly, and is told of findings through a weak
        # method: a cycle here would keep the roots (the user's model, through a closure)
        # alive after the tracker, until a gc.collect() that gc.disable() may never run.
        self.detector = Detector(
            weakref.proxy(self),
            owner=self.owner,
            rule=rule,
            roots=self.roots,
            on_finding=weak_method(self._finding),
            unit=self.unit,
        )

    @property
    def findings(self) -> list[Finding]:
        """The leaks found so far (see :mod:`leakfree.diagnostics.detector`)."""
        return self.detector.findings

    @property
    def judged(self) -> str:
        """The device the detector judges: the first accelerator tracked, else the CPU."""
        return self._key(None)

    def _finding(self, finding: Finding) -> None:
        if self.on_finding is not None:
            self.on_finding(finding)
        if self.warn:
            warnings.warn(finding.message, MemoryGrowthWarning, stacklevel=4)

    def _on_backward(self, frame: FrameType | None) -> None:
        if threading.get_ident() != self._thread:
            return  # another thread's backward: not a microbatch of this loop
        self.detector.guard(self._after_backward, frame)

    def _after_backward(self, frame: FrameType | None) -> None:
        storages = self._storages
        made = storages.created if storages is not None and self._tracking else None
        if self._heap is not None and not self._tracking:  # the CPU's count, between
            self.detector.backward(self._heap(), frame, noisy=True)  # tracked steps
            return
        if storages is not None and not self._tracking:
            return  # a step the sampling tracker does not track
        live = self.sample().get(self.judged)
        if live is not None:
            if made is None or not self._counted(torch.device(self.judged)):
                made = self._allocated_total(torch.device(self.judged))
            self.detector.backward(live, frame, made=made)

    def _counted(self, device: torch.device) -> bool:
        """Is ``device`` counted by the storage tracker (no allocator statistics)?"""
        return self._allocator_bytes(device) is None

    @property
    def storage_tracker(self) -> StorageTracker | None:
        """The storage-by-storage tracker while one is active (None on an allocator's
        count alone, or outside the ``with``)."""
        return self._storages

    def __enter__(self) -> MemoryTracker:
        self._storages = None  # on an allocator's count alone, no op pays for tracking
        self._heap = None
        judged = torch.device(self.judged)
        if self._counted(judged) and judged.type == "cpu" and self.sample_every > 1:
            self._heap = heap_counter()  # the cheap signal read at every boundary
        if any(self._counted(d) for d in self.devices):
            self._storages = StorageTracker(sites=self.sites)
            self._depth = torch._C._len_torch_dispatch_stack()
            self._storages.__enter__()  # type: ignore[no-untyped-call]
            self._tracking = True
            WATCHING.append(self._storages)
        if self.microbatches:
            self._thread = threading.get_ident()
            self._backward = on_backward(self._on_backward)
        return self

    def __exit__(self, *exc: object) -> None:
        self._heap = None
        handle, self._backward = self._backward, None
        if handle is not None:
            handle.remove()
        if self._storages is not None:
            if self._storages in WATCHING:
                WATCHING.remove(self._storages)
            if self._tracking:
                self._tracking = False
                self._storages.__exit__(*exc)  # type: ignore[no-untyped-call]

    def _allocated_total(self, device: torch.device) -> int | None:
        """Bytes the allocator has handed out since the process started (a running total,
        frees not subtracted), where it counts them."""
        if device.type in ("cpu", "meta"):
            return None
        stats = getattr(device_module(device), "memory_stats", None)
        if stats is None:
            return None
        try:
            total = stats(device).get("allocated_bytes.all.allocated")
        except (RuntimeError, TypeError, AttributeError):
            return None
        return int(total) if total is not None else None

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
        if tracked:
            now = self.sample()
        else:  # only the allocator-read devices: no walk over the tracked storages
            now = {}
            for device in self.devices:
                allocator = self._allocator_bytes(device)
                if allocator is not None:
                    now[str(device)] = allocator
        for key, value in now.items():
            self._record(key, index, value)
        for growth in self.allocators.values():
            growth.step()
        if self._storages is not None:
            self._storages.epoch = index + 1  # storages made from now on: the next step's
        signal = self._heap() if self._heap is not None else None
        detector = self.detector
        detector.guard(detector.step, now.get(self.judged), sys._getframe(1), signal)
        if self._storages is not None and self.sample_every > 1:
            if index + 1 > self._next:  # draw the next tracked step: gaps average k
                self._next = index + self._rng.randint(1, 2 * self.sample_every - 1)
            # Every step is followed while growth is being confirmed and, without a cheap
            # signal, until the run has been judged clean once.
            exact = detector.confirming or (
                self._heap is None and detector.judged_steps < detector.needed_steps
            )
            self._track(exact or index + 1 == self._next)
        return now

    def _record(self, key: str, index: int, value: int) -> None:
        """Add step ``index``'s ``value`` to ``key``'s series, which keeps one value in
        ``stride`` (evenly spaced) besides the latest, halving itself when full."""
        values = self.series.setdefault(key, [])
        at = self.steps.setdefault(key, [])
        numbers = self._numbers.setdefault(key, [])
        n = self._recorded.get(key, 0)
        self._recorded[key] = n + 1
        stride = self._stride.get(key, 1)
        if numbers and numbers[-1] % stride:  # the latest stood in for the next one kept
            values[-1], at[-1], numbers[-1] = value, index, n
        else:
            values.append(value)
            at.append(index)
            numbers.append(n)
        if len(values) > self.MAX_POINTS:
            del values[1::2], at[1::2], numbers[1::2]
            self._stride[key] = 2 * stride

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
        return fit_growth(*self._after(key, skip))

    def _after(self, key: str, skip: int) -> tuple[list[int], list[int]]:
        """``key``'s values from step ``skip`` on, and the number of each (its place among
        the values recorded)."""
        kept = zip(self.series[key], self.steps[key], self._numbers.get(key, []))
        pairs = [(v, n) for v, i, n in kept if i >= skip]
        return [v for v, _ in pairs], [n for _, n in pairs]

    def _key(self, device: str | torch.device | None) -> str:
        if device is None:
            keys = list(self.series)
            accelerated = [k for k in keys if not k.startswith("cpu")]
            return accelerated[0] if accelerated else keys[0]
        key = str(torch.device(device))
        if key not in self.series:
            raise KeyError(f"device {key!r} is not tracked; tracked: {', '.join(self.series)}")
        return key

    def allocator_verdicts(self) -> dict[str, CacheVerdict]:
        """Per accelerator read from its allocator, from the end of the warm-up to the last
        step: whether what tensors hold grew (a leak), what the allocator keeps reserved
        beyond it (its cache, fragmentation), both or neither, with the knob that helps
        (:class:`~leakfree.diagnostics.cache.CacheVerdict`). Devices with fewer than two
        steps after the warm-up are left out."""
        verdicts = {}
        for key, allocator in self.allocators.items():
            verdict = allocator.verdict(self._warmup)
            if verdict is not None:
                verdicts[key] = verdict
        return verdicts

    def report(self, *, skip: int = 1, findings: bool = True) -> str:
        """A table: per device, steps, first and last live bytes, growth per step; then
        each finding (with ``findings``)."""
        rows = []
        for key, values in self.series.items():
            if not values:
                continue
            g = fit_growth(*self._after(key, skip))
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
        table = format_table(("device", "steps", "first", "last", "growth per step"), rows)
        cache = [
            f"{key}: {v.message}"
            for key, v in self.allocator_verdicts().items()
            if v.kind != "none"
        ]
        if cache:
            table += "\n\n" + "\n".join(cache)
        if not findings or not self.findings:
            return table
        return table + "\n\n" + "\n\n".join(f.message for f in self.findings)
