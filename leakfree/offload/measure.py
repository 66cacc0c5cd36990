"""Measuring one step on the device, for the plans of :mod:`leakfree.offload.plan`.

:class:`Marks` notes points of the work issued to the device (timing events on an
accelerator's current stream; the host's clock on the CPU) and reads the seconds between
them once the last has completed: one host wait, when the step is over. :func:`bandwidth`
times one copy each way between the device and pinned host memory.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["Marks", "bandwidth"]


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


def bandwidth(
    device: torch.device, module: Any, streams: tuple[Any, Any], nbytes: int
) -> tuple[float, float]:
    """Bytes per second of one ``nbytes`` copy to pinned host memory and one back, each on
    its side stream (``streams``: out, back) into memory of that stream, timed with events;
    the host waits for each. On the CPU (``module`` None), one host copy timed by the
    host's clock, both ways."""
    if module is None:
        src = torch.empty(nbytes, dtype=torch.uint8)
        start = time.perf_counter()
        torch.empty_like(src).copy_(src)
        seconds = time.perf_counter() - start
        rate = nbytes / seconds if seconds > 0 else float("inf")
        return rate, rate
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rates = []
    for side, out in zip(streams, (True, False)):
        with module.stream(side):
            dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
            begin = module.Event(enable_timing=True)
            end = module.Event(enable_timing=True)
            begin.record(side)
            if out:
                host.copy_(dev, non_blocking=True)
            else:
                dev.copy_(host, non_blocking=True)
            end.record(side)
        end.synchronize()  # before the host block is used again, or freed
        ms = begin.elapsed_time(end)
        rates.append(nbytes / (ms / 1e3) if ms > 0 else float("inf"))
    return rates[0], rates[1]
