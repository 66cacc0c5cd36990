"""Measuring one step on the device, for the plans of :mod:`leakfree.offload.plan`.

:class:`StepMeasure` follows one step: when each saved storage was saved, where the
forward and backward begin and end, and the device's memory at each of backward's first
unpacks; at the end it gives a :class:`~leakfree.offload.plan.Measurement`. :class:`Marks`
notes points of the work issued to the device (timing events on an accelerator's current
stream; the host's clock on the CPU) and reads the seconds between them once the last has
completed: one host wait, when the step is over. Nothing here holds a tensor past its
call.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from leakfree._allocator import Counts, Span
from leakfree.offload.link import Link
from leakfree.offload.plan import Measurement

__all__ = ["Marks", "StepMeasure"]


class Marks:
    """Points in the device's work, in the order issued: ``mark()`` notes one and returns
    its index; ``seconds()`` waits for the last and gives each one's time from the first.
    Holds events only (no tensor)."""

    def __init__(self, device: torch.device, module: Any) -> None:
        self.device = device
        self.module = module  # the device's module; None: the host's clock
        self.points: list[Any] = []

    def mark(self) -> int:
        if self.module is None:
            self.points.append(time.perf_counter())
        else:
            event = self.module.Event(enable_timing=True)
            event.record(self.module.current_stream(self.device))
            self.points.append(event)
        return len(self.points) - 1

    def seconds(self) -> list[float]:
        if not self.points:
            return []
        first = self.points[0]
        if self.module is None:
            return [p - first for p in self.points]
        self.points[-1].synchronize()
        return [first.elapsed_time(p) / 1e3 for p in self.points]


class StepMeasure:
    """One step measured for a goal's plan, from its forward's start.

    The hooks call :meth:`saved` for each storage saved, :meth:`forward_done` at the
    forward's end, :meth:`backward_begins` at backward's first unpack, :meth:`sample` at
    each first unpack (what the device allocates now, and the most since the sample
    before: :class:`~leakfree._allocator.Span`, which never resets the user's peak
    statistics), :meth:`wait` where the compute stream waits for a copy (the time it
    waits is not compute), and :meth:`finish` when backward is over. What the device held
    (its allocator's reserved bytes) is read beside what it allocated: the most beyond the
    allocated peak is the step's spare. On the CPU (``read`` None) the saved bytes stand
    for the peak."""

    def __init__(
        self,
        device: torch.device,
        module: Any,
        moved: int,
        read: Callable[[], Counts] | None = None,
    ) -> None:
        self.device = device
        self.span = Span(read) if read is not None else None
        #: what the device held before the step
        self.allocated = self.span.start.allocated if self.span is not None else 0
        self.marks = Marks(device, module)
        self.start = self.marks.mark()
        self.copies: list[int] = []  # the mark of each storage's save
        self.moved = moved  # the bytes moved before the step
        self.sizes: tuple[int, ...] | None = None
        self.forward: int | None = None
        self.backward: int | None = None
        #: at each first unpack: (allocated, the most allocated since the one before), and
        #: (bytes backward had used, bytes it had brought back)
        self.samples: list[tuple[int, int]] = []
        self.used: list[tuple[int, int]] = []
        self.needed = self.restored = 0
        #: the compute stream's waits for copies: (the mark before, the mark after)
        self.waits: list[tuple[int, int]] = []
        self._most = 0  # the most allocated since the last sample, read at saves

    @property
    def module(self) -> Any:
        """The device's module where its allocator is read (None: the CPU)."""
        return self.marks.module if self.span is not None else None

    def wait(self, stream: Any, event: Any) -> None:
        """``stream.wait_event(event)``, timed: what the stream waits is not compute."""
        before = self.marks.mark()
        stream.wait_event(event)
        self.waits.append((before, self.marks.mark()))

    def saved(self) -> None:
        """A storage was saved: its time, and what the forward allocated at most since
        the save before (read at every save, the bound :class:`Span` gives, where the
        process's peak does not rise, is that of one operation's allocations)."""
        self.copies.append(self.marks.mark())
        if self.span is not None:
            self._most = max(self._most, self.span.read()[1])

    def forward_done(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes
        self.forward = self.marks.mark()

    def backward_begins(self) -> None:
        if self.forward is not None and self.backward is None:
            self.backward = self.marks.mark()

    def sample(self, nbytes: int, *, moved: bool) -> None:
        """Backward's first unpack of ``nbytes`` (brought back if ``moved``, else held)."""
        if self.backward is None or self.span is None:
            return
        self.needed += nbytes
        self.restored += nbytes if moved else 0
        allocated, most = self.span.read()
        self.samples.append((allocated, max(most, self._most)))
        self._most = 0
        self.used.append((self.needed, self.restored))

    def finish(
        self, moved: int, probe: Callable[[int], Link]
    ) -> tuple[Measurement, tuple[int, ...]] | None:
        """Backward is over (``moved``: the bytes moved to the host so far; ``probe(n)``:
        the link, measured with ``n`` bytes if not yet): the measurement,
        and how far backward's allocations rose after each sample (:func:`_rises`); None
        where the step saved what its forward did not record."""
        sizes, marks = self.sizes, self.marks
        if sizes is None or self.forward is None or self.backward is None:
            return None
        end = marks.mark()
        seconds = marks.seconds()
        start = seconds[self.start]
        waited = _waited(seconds, self.waits)
        made = tuple(seconds[i] - start - waited(i) for i in self.copies)
        if len(made) != len(sizes):
            return None
        forward = seconds[self.forward] - start - waited(self.forward)
        backward = seconds[end] - seconds[self.backward]
        gap = max(0.0, seconds[self.backward] - seconds[self.forward])
        moved -= self.moved
        if moved:  # backward waited for copies back: its compute, about twice the forward's
            backward = min(backward, 2 * forward)
        needed = floor = spare = 0
        rises: tuple[int, ...] = ()
        if self.span is not None:
            _, last = self.span.read()  # the most allocated since the last sample
            # what the device held beyond the most it surely allocated (a bound from above
            # of the most would understate it)
            spare = max(0, self.span.held - self.span.seen)
            peak, needed, floor = _peaks(self.samples, self.used, last, moved)
            peak, floor = peak - self.allocated, max(0, floor - self.allocated)
            rises = _rises([*self.samples, (0, last)])
        else:
            peak = sum(sizes)
        link = probe(max(1 << 20, min(_PROBE_BYTES, max(sizes, default=0))))
        measurement = Measurement(
            sizes,
            made,
            forward,
            backward,
            link.to_host,
            link.to_device,
            peak,
            needed,
            floor,
            spare,
            duplex=link.duplex,
            gap=gap,
        )
        return measurement, rises


def _waited(seconds: list[float], waits: list[tuple[int, int]]) -> Callable[[int], float]:
    """Seconds the compute stream waited for copies before mark ``i``, as a function."""
    spans = [(after, seconds[after] - seconds[before]) for before, after in waits]

    def before(i: int) -> float:
        return sum(d for after, d in spans if after <= i)

    return before


#: the bytes of the copies that measure the link for a goal's plan
_PROBE_BYTES = 64 << 20


#: the first unpacks of backward that still count as its beginning (the loss and the
#: output head, where a step's peak usually is: all its activations, and the head's
#: gradients)
_BEGINNING = 2


def _peaks(
    samples: list[tuple[int, int]], used: list[tuple[int, int]], last: int, moved: int
) -> tuple[int, int, int]:
    """From a measured step's samples (the device's allocated bytes at each first unpack of
    backward, the most it allocated since the one before, and the bytes backward had used
    and brought back by then) and what it allocated at most after the last one: the peak
    had it moved nothing, the bytes backward had used by then, and the floor a plan's peak
    cannot go under.

    A step measured keeping everything (``moved`` 0) peaks where it peaks, and moving
    what it had used by then lowers nothing. A step that moved everything: had it moved
    nothing, it would have peaked as it began backward (all of its activations on the
    device, and the head's gradients), the bytes it moved higher, less what it had
    brought back by then; what it allocated later (brought back and made by backward,
    as any plan's backward would) is the floor."""
    peaks = [peak for _, peak in samples] + [last]
    if not samples:
        return last, 0, 0
    if moved == 0:
        at = max(range(len(peaks)), key=peaks.__getitem__)
        needed = used[min(at, len(used) - 1)][0]
        return peaks[at], needed, 0
    begin = min(_BEGINNING, len(samples)) - 1
    start = max(peaks[: begin + 1])
    needed, restored = used[begin]
    return start + moved - restored, needed, max(peaks[begin + 1 :], default=0)


def _rises(samples: list[tuple[int, int]]) -> tuple[int, ...]:
    """For each of a measured backward's points (``samples``: the device's allocated bytes
    at each first unpack, and the most it allocated since the point before), how far its
    allocations rose above that point later on."""
    rises = [0] * len(samples)
    ahead = 0  # the most allocated after the point at hand
    for i in range(len(samples) - 1, -1, -1):
        allocated, peak = samples[i]
        rises[i] = max(0, ahead - allocated)
        ahead = max(ahead, allocated, peak)
    return tuple(rises)
