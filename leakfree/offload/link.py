"""The link between the device and pinned host memory, measured as the plan uses it.

A goal's plan (:mod:`leakfree.offload.plan`) schedules copies out in forward and back in
backward, beside compute, and the two directions at once where backward begins while the
last copies out still run. A link need not run both directions at full rate (some PCIe
hosts give the second direction well under half of its rate; a half-duplex path runs one
at a time), nor each direction at its full rate beside compute (the copies read and write
the same memory the kernels do). :func:`probe` measures, once per manager:

* each direction alone;
* each direction beside compute (matrix products on the compute stream all the while):
  the rates the plan schedules with (:attr:`Link.to_host`, :attr:`Link.to_device`);
* both directions at once: :attr:`Link.duplex`, the share of its rate each direction
  keeps while the other one copies (1 on a full-duplex link; 0.5 when the two share one
  direction's rate, as a half-duplex link does).

It holds its buffers for the call only: two pinned host blocks of the probe's size, two
device buffers, and the product's operands.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = ["Link", "probe"]


class Link(NamedTuple):
    """Bytes per second each way beside compute (what the plan schedules with), the share
    of it each direction keeps while the other copies (``duplex``), and each direction
    alone (``alone``: out, back; reported)."""

    to_host: float
    to_device: float
    duplex: float = 1.0
    alone: tuple[float, float] | None = None


#: no link is measured under this share: a direction that all but stops while the other
#: one copies is scheduled as one that runs at this share of its rate
_LEAST_SHARE = 0.05

#: how long the products beside the copies run, against the copies themselves
_COMPUTE_SPAN = 2.5


def probe(device: torch.device, module: Any, streams: tuple[Any, Any], nbytes: int) -> Link:
    """The link of ``device`` (its ``module``, as ``torch.cuda``), measured with copies of
    ``nbytes``, out on ``streams[0]`` and back on ``streams[1]`` (the side streams of the
    copies), timed with events; the host waits for each measurement. On the CPU
    (``module`` None): one host copy timed by the host's clock, both ways, full duplex."""
    if module is None:
        src = torch.empty(nbytes, dtype=torch.uint8)
        start = time.perf_counter()
        torch.empty_like(src).copy_(src)
        seconds = time.perf_counter() - start
        rate = nbytes / seconds if seconds > 0 else float("inf")
        return Link(rate, rate, 1.0, (rate, rate))
    out_stream, back_stream = streams
    # Measured on an idle device: a copy queued before (a batch's, in the same copy
    # engines) would be timed with ours, and a direction that runs beside it as the share
    # the other leaves it. The probe waits for its copies anyway; this is one wait more.
    module.synchronize(device)
    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    with module.stream(out_stream):
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    with module.stream(back_stream):
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def out() -> None:
        host_out.copy_(src, non_blocking=True)

    def back() -> None:
        dst.copy_(host_in, non_blocking=True)

    alone_out = _timed(module, out_stream, out)
    alone_back = _timed(module, back_stream, back)
    both = _both(device, module, (out_stream, out), (back_stream, back))
    beside_out, beside_back = _beside(device, module, (out_stream, out), (back_stream, back))
    duplex = max(alone_out, alone_back) / both if both > 0 else 1.0
    return Link(
        _rate(nbytes, beside_out),
        _rate(nbytes, beside_back),
        min(1.0, max(_LEAST_SHARE, duplex)),
        (_rate(nbytes, alone_out), _rate(nbytes, alone_back)),
    )


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds if seconds > 0 else float("inf")


def _timed(module: Any, stream: Any, copy: Callable[[], None]) -> float:
    """Seconds of ``copy`` on ``stream``, alone (the host waits for it)."""
    begin = module.Event(enable_timing=True)
    end = module.Event(enable_timing=True)
    with module.stream(stream):
        begin.record(stream)
        copy()
        end.record(stream)
    end.synchronize()
    return float(begin.elapsed_time(end)) / 1e3


def _both(device: torch.device, module: Any, *copies: tuple[Any, Callable[[], None]]) -> float:
    """Seconds from the start of the first of ``copies`` (each on its stream, issued one
    after the other on an idle device) to the end of the last."""
    ends = []
    begin = module.Event(enable_timing=True)
    for i, (stream, copy) in enumerate(copies):
        with module.stream(stream):
            if i == 0:
                begin.record(stream)
            copy()
            end = module.Event(enable_timing=True)
            end.record(stream)
            ends.append(end)
    for end in ends:
        end.synchronize()
    return max(float(begin.elapsed_time(end)) for end in ends) / 1e3


def _product(a: torch.Tensor) -> None:
    torch.mm(a, a)


def _beside(
    device: torch.device, module: Any, *copies: tuple[Any, Callable[[], None]]
) -> list[float]:
    """Seconds of each of ``copies``, one after the other, while the compute stream runs
    matrix products all the while (long enough by :data:`_COMPUTE_SPAN` against the
    copies alone)."""
    compute = module.current_stream(device)
    alone = sum(_timed(module, stream, copy) for stream, copy in copies)
    # a product of a size that takes a fraction of the copies (from 256 x 256, doubling)
    side = 256
    while True:
        a = torch.empty(side, side, device=device)
        one = _timed(module, compute, functools.partial(_product, a))
        if one * 8 >= alone or side >= 4096:
            break
        side *= 2
    count = 1 if one <= 0 else min(256, max(1, math.ceil(_COMPUTE_SPAN * alone / one)))
    go = module.Event()
    _product(a)
    go.record(compute)
    for _ in range(count - 1):
        _product(a)
    seconds = []
    for stream, copy in copies:  # each once compute runs; the host waits for each
        stream.wait_event(go)
        seconds.append(_timed(module, stream, copy))
    compute.synchronize()
    return seconds
