"""A timing model of an accelerator, fed by the simulated device's launches.

The simulated device runs every operation at once on the host; what a GPU would take is
modelled here, so that a step on ``sim`` yields a predicted timeline: when each kernel and
each copy would start and end, on which engine, and when the host would wait.

The model is the ordering CUDA gives, with durations from a device's rates:

* **Engines.** Kernels run on one compute engine, one at a time (kernels of different
  streams overlapping on the SMs are not modelled: the large ones of a training step fill
  the device). Copies run on a copy engine per direction, device-to-host and
  host-to-device, so the two directions overlap each other and compute; copies of one
  direction run one at a time, in the order issued. The link is full duplex unless
  :attr:`Rates.duplex` says otherwise: a copy then gets that share of its bandwidth while
  a copy the other way, issued before it, runs (0: it waits for it, a half-duplex link).
* **Streams.** Work on a stream runs in the order issued; an operation starts when its
  stream's previous one ended, when every event its stream waits on has completed, when
  its engine is free, and not before the host issued it.
* **Events.** An event recorded on a stream completes when the work issued to that stream
  before the record has ended; ``wait_event`` / ``wait_stream`` hold back what is issued
  to the waiting stream after it.
* **The host** issues operations in program order, paying :attr:`Rates.launch` for each,
  and waits where the program synchronizes (a stream, an event, the device, a blocking
  copy): its clock then moves to the completion it waited for.
* **Durations.** A kernel takes the longer of its FLOPs at :attr:`Rates.flops` and its
  bytes at :attr:`Rates.memory`, at least :attr:`Rates.kernel_min`; a copy takes its bytes
  at the direction's bandwidth.

:class:`Timeline` is the model; :class:`attach` feeds it the simulated device's launches
and stream events (``with attach(H100) as timeline:``), FLOPs counted by
``torch.utils.flop_counter``'s formulas. Nothing here is in leakfree's runtime path.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from . import device as _device

COMPUTE, TO_HOST, TO_DEVICE = "compute", "to_host", "to_device"
ENGINES = (COMPUTE, TO_HOST, TO_DEVICE)


@dataclass(frozen=True)
class Rates:
    """What a device does per second, and what each launch costs the host."""

    name: str
    flops: float  #: FLOP/s that large kernels reach (matmuls, attention)
    memory: float  #: bytes/s that memory-bound kernels reach
    to_host: float  #: copy engine, device to pinned host memory, bytes/s
    to_device: float  #: copy engine, pinned host memory to device, bytes/s
    launch: float  #: host seconds to issue one operation
    kernel_min: float  #: the shortest a kernel takes, seconds
    #: what a copy gets of its direction's bandwidth while a copy the other way, issued
    #: before it, runs: 1 a full-duplex link, 0 a half-duplex one (it waits), between: a
    #: link whose second direction runs slower
    duplex: float = 1.0


#: one H100 80GB (SXM), torch 2.11, bf16. Measured in the H100 run: the copy
#: bandwidths (pinned, non-blocking, 1 GiB). Assumed: memory-bound kernels at 2.8 TB/s
#: (84% of HBM3's 3.35), the launch and shortest-kernel times. Fitted: the FLOP rate, on
#: the steps without offloading of both H100 tables, each at its own size (76.2 ms at
#: intermediate 5632, 78.7 ms at 5440; ``calibration.fit_flops``, ``calibration.FITTED``);
#: 593 TFLOP/s is 60% of the bf16 dense peak, what eager matmuls and flash attention
#: reach. Every offloading row is held out (``calibration.py`` reports the errors).
H100 = Rates(
    name="H100",
    flops=5.93e14,
    memory=2.8e12,
    to_host=55.0e9,
    to_device=54.3e9,
    launch=6e-6,
    kernel_min=2.5e-6,
)


@dataclass(frozen=True)
class Op:
    """One operation on the timeline."""

    name: str
    engine: str
    stream: int
    start: float
    end: float
    flops: float = 0.0
    nbytes: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """The predicted timeline of the work issued to one device (seconds from the start)."""

    rates: Rates
    host: float = 0.0  #: the host's clock: when it issues its next operation
    ops: list[Op] = field(default_factory=list)
    _stream_end: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    _waits: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    _engine_free: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ENGINES, 0.0))
    _events: dict[int, float] = field(default_factory=dict)
    #: each copy engine's copies: (start, end), and their ends, in order (both increase)
    _copy_spans: dict[str, list[tuple[float, float]]] = field(
        default_factory=lambda: {TO_HOST: [], TO_DEVICE: []}
    )
    _copy_ends: dict[str, list[float]] = field(default_factory=lambda: {TO_HOST: [], TO_DEVICE: []})
    #: device memory as the simulated device's caching allocator counts it
    #: (``allocator.py``), in host order: ``allocated`` (``memory_allocated``) and
    #: ``reserved`` (``memory_reserved``) now, and their peaks since the timeline began,
    #: ``peak`` and ``held_peak`` (whatever the program does with
    #: ``reset_peak_memory_stats``). A block freed while copies on other streams still
    #: read it (``record_stream``) is held until the timeline says they have ended.
    allocated: int = 0
    reserved: int = 0
    peak: int = 0
    held_peak: int = 0
    #: every call that moved the clocks, in order (what :meth:`replay` re-issues)
    calls: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)

    # -- the device's work ----------------------------------------------------------------

    def kernel(self, stream: int, flops: float, nbytes: int, name: str = "kernel") -> Op:
        """A kernel on ``stream``: ``flops`` at the compute rate or ``nbytes`` at the
        memory rate, whichever is longer."""
        self.calls.append(("kernel", (stream, flops, nbytes, name)))
        r = self.rates
        seconds = max(flops / r.flops, nbytes / r.memory, r.kernel_min)
        return self._run(name, COMPUTE, stream, seconds, flops=flops, nbytes=nbytes)

    def copy(self, stream: int, nbytes: int, engine: str, name: str = "copy") -> Op:
        """A copy between the device and pinned host memory on ``stream``, on the copy
        engine of its direction (:data:`TO_HOST` or :data:`TO_DEVICE`)."""
        if engine not in (TO_HOST, TO_DEVICE):
            raise ValueError(f"copy(engine={engine!r}): expected {TO_HOST!r} or {TO_DEVICE!r}")
        self.calls.append(("copy", (stream, nbytes, engine, name)))
        bandwidth = self.rates.to_host if engine == TO_HOST else self.rates.to_device
        other = TO_DEVICE if engine == TO_HOST else TO_HOST
        op = self._run(name, engine, stream, nbytes / bandwidth, nbytes=nbytes, beside=other)
        self._copy_ends[engine].append(op.end)
        self._copy_spans[engine].append((op.start, op.end))
        return op

    def _run(
        self,
        name: str,
        engine: str,
        stream: int,
        seconds: float,
        beside: str | None = None,
        **sizes: Any,
    ) -> Op:
        self.host += self.rates.launch
        start = max(
            self.host, self._stream_end[stream], self._waits[stream], self._engine_free[engine]
        )
        end = start + seconds
        if beside is not None and self.rates.duplex < 1.0:
            end = self._shared(beside, start, seconds)
        op = Op(name, engine, stream, start, end, **sizes)
        self._stream_end[stream] = self._engine_free[engine] = op.end
        self.ops.append(op)
        return op

    def _shared(self, other: str, start: float, seconds: float) -> float:
        """When a copy of ``seconds`` alone, starting at ``start``, ends on a link that
        gives it :attr:`Rates.duplex` of its rate while the ``other`` direction's copies
        (issued before it) run."""
        share = self.rates.duplex
        spans = self._copy_spans[other]
        t, left = start, seconds  # ``left``: seconds of work at the full rate
        for a, b in spans[bisect.bisect_right(self._copy_ends[other], start) :]:
            if a > t:  # the link is the copy's alone until the other's next copy
                if left <= a - t:
                    return t + left
                left -= a - t
                t = a
            if share > 0 and left <= (b - t) * share:
                return t + left / share
            left -= (b - t) * share
            t = b
        return t + left

    # -- ordering -----------------------------------------------------------------------

    def record(self, event: int, stream: int) -> None:
        """``event.record(stream)``: it completes when the stream's work so far has ended."""
        self.calls.append(("record", (event, stream)))
        self._events[event] = max(self._stream_end[stream], self._waits[stream], self.host)

    def wait(self, stream: int, event: int) -> None:
        """``stream.wait_event(event)``: later work on ``stream`` starts after it."""
        self.calls.append(("wait", (stream, event)))
        self._waits[stream] = max(self._waits[stream], self._events.get(event, 0.0))

    def sync_stream(self, stream: int) -> None:
        """The host waits for everything issued to ``stream``."""
        self.calls.append(("sync_stream", (stream,)))
        self.host = max(self.host, self._stream_end[stream], self._waits[stream])

    def sync_event(self, event: int) -> None:
        """The host waits for ``event``."""
        self.calls.append(("sync_event", (event,)))
        self.host = max(self.host, self._events.get(event, 0.0))

    def sync_device(self) -> None:
        """The host waits for everything issued."""
        self.calls.append(("sync_device", ()))
        self.host = max(self.host, *self._stream_end.values(), 0.0)

    def event_time(self, event: int) -> float:
        """When ``event`` completes (seconds; 0.0 if it was never recorded)."""
        return self._events.get(event, 0.0)

    def done(self, event: int) -> bool:
        """``event.query()``: whether it has completed by the host's clock (an event never
        recorded has)."""
        return self._events.get(event, 0.0) <= self.host

    def stream_done(self, stream: int) -> bool:
        """``stream.query()``: whether everything issued to it has completed by now."""
        return max(self._stream_end[stream], self._waits[stream]) <= self.host

    def mark(self, stream: int) -> float:
        """When the work issued to ``stream`` so far will have ended (an event recorded
        now, unnamed: the caching allocator's)."""
        return max(self._stream_end[stream], self._waits[stream], self.host)

    def replay(self, rates: Rates) -> Timeline:
        """The same work, issued in the same order, on a device of ``rates`` (memory is
        not replayed; a host wait the caching allocator made is left out)."""
        timeline = Timeline(rates)
        for name, args in self.calls:
            getattr(timeline, name)(*args)
        return timeline

    # -- memory ---------------------------------------------------------------------------

    def memory(self, allocated: int, reserved: int) -> None:
        """The allocator's counts after a change: now, and the peaks."""
        self.allocated, self.reserved = allocated, reserved
        self.peak = max(self.peak, allocated)
        self.held_peak = max(self.held_peak, reserved)

    @property
    def held(self) -> int:
        """What the device holds now: ``reserved``."""
        return self.reserved

    # -- reading it -----------------------------------------------------------------------

    @property
    def end(self) -> float:
        """When the last operation ends, or the host's clock if later."""
        return max(self.host, *(op.end for op in self.ops), 0.0)

    def busy(self, engine: str) -> float:
        """Seconds ``engine`` is busy."""
        return sum(op.seconds for op in self.ops if op.engine == engine)

    def overlap(self, first: str, second: str) -> float:
        """Seconds during which both engines are busy at once."""
        return _intersection(self._spans(first), self._spans(second))

    def _spans(self, engine: str) -> list[tuple[float, float]]:
        # one engine runs one operation at a time: its spans never overlap
        return sorted((op.start, op.end) for op in self.ops if op.engine == engine)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        low, high = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, high - low)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


# --- fed by the simulated device -----------------------------------------------------------


def _device_bytes(values: Any) -> int:
    total = 0
    for v in torch.utils._pytree.tree_leaves(values):
        if isinstance(v, torch.Tensor) and v.device.type == _device.NAME:
            total += v.nbytes
    return total


#: the CPU's flash attention, which the simulated device runs where a GPU runs its own:
#: 2 matmuls of B x H x Sq x Sk x D forward, 5 backward, half of them under a causal mask
#: (a flash kernel skips the masked blocks); ``torch.utils.flop_counter`` has no formula
_ATTENTION = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": (2, 0, 4),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": (5, 1, 7),
}


def _attention_flops(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    matmuls, query_at, causal_at = _ATTENTION[name]
    q, k = args[query_at], args[query_at + 1]
    b, h, sq, d = q.shape
    flops = matmuls * 2 * b * h * sq * k.shape[-2] * d
    causal = args[causal_at] if len(args) > causal_at else kwargs.get("is_causal", False)
    return flops / 2 if causal else flops


def _flops(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> float:
    if name in _ATTENTION:
        return _attention_flops(name, args, kwargs)
    namespace, _, op = name.partition("::")
    packet = getattr(getattr(torch.ops, namespace, None), op.split(".")[0], None)
    formula = flop_registry.get(packet) if packet is not None else None
    if formula is None:
        return 0.0
    return float(formula(*args, **kwargs, out_val=out))


class Timer:
    """Turns the simulated device's launches and stream events into a :class:`Timeline`."""

    def __init__(self, rates: Rates) -> None:
        self.timeline = Timeline(rates)

    def launch(
        self, schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, stream: int
    ) -> None:
        if schema.name == "aten::copy_" and len(args) >= 2:
            dst, src = args[0], args[1]
            if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
                if dst.device.type != _device.NAME:
                    self.timeline.copy(stream, dst.nbytes, TO_HOST, schema.name)
                    return
                if src.device.type != _device.NAME:
                    self.timeline.copy(stream, dst.nbytes, TO_DEVICE, schema.name)
                    return
        flops = _flops(schema.name, args, kwargs, out)
        nbytes = _device_bytes((args, kwargs)) + _device_bytes(out)
        self.timeline.kernel(stream, flops, nbytes, schema.name)

    def event(self, handler: str, *args: Any) -> None:
        t = self.timeline
        if handler == "_handle_event_record":
            t.record(args[0], args[1])
        elif handler == "_handle_event_wait":
            t.wait(args[1], args[0])
        elif handler == "_handle_stream_synchronization":
            t.sync_stream(args[0])
        elif handler == "_handle_event_synchronization":
            t.sync_event(args[0])
        elif handler == "_handle_device_synchronization":
            t.sync_device()


class attach:
    """``with attach(H100) as timeline:`` models what the simulated device is given inside
    the block (the device must be on)."""

    def __init__(self, rates: Rates) -> None:
        self.timer = Timer(rates)

    def __enter__(self) -> Timeline:
        if _device._STATE.timer is not None:
            raise RuntimeError("a timer is already attached")
        _device._STATE.timer = self.timer
        _device._STATE.observe(_device._STATE.device)  # the counts it starts from
        return self.timer.timeline

    def __exit__(self, *exc: object) -> None:
        _device._STATE.timer = None
