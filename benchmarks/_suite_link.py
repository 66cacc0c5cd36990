"""The GPU suite's link part: pinned copies between the device and the host, GB/s.

Device to host alone, host to device alone, both at once (each direction on a side
stream of its own, each with its own pinned host buffer: a pageable buffer makes its copy
synchronous and serialises the two), and both beside compute (large matmuls on the
compute stream meanwhile). The H100 model (``tests/simdev/timing.py``) assumes a full-duplex
link at 55.0 GB/s out and 54.3 GB/s back, whatever runs beside it; this part says whether
the GPU agrees. Every copy is timed by events on its own stream.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from _suite_device import Bench

#: the H100 run's pinned copy bandwidths (1 GiB, ``non_blocking=True``), GB/s
PREDICTED = {"to_host": 55.0, "to_device": 54.3}


def link(bench: Bench, nbytes: int, *, repeats: int = 3) -> dict[str, Any]:
    """The bandwidths of ``repeats`` copies of ``nbytes`` each way, in GB/s."""
    module, device = bench.module, bench.device
    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # device -> host
    host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # host -> device
    dev_out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_in = torch.empty(nbytes, dtype=torch.uint8, device=device)
    copies: dict[str, tuple[Any, Callable[[], Any]]] = {
        "to_host": (module.Stream(), lambda: host_out.copy_(dev_out, non_blocking=True)),
        "to_device": (module.Stream(), lambda: dev_in.copy_(host_in, non_blocking=True)),
    }
    side = 8192 if nbytes >= 1 << 28 else 2048  # about 2 ms a matmul on an H100
    a = torch.randn(side, side, dtype=bench.dtype, device=device)
    with bench.clock():  # (the H100 model times the events on the simulated device)
        for _, copy in copies.values():  # first use, untimed
            copy()
        bench.sync()
        out: dict[str, Any] = {"bytes": nbytes, "repeats": repeats}
        for name in copies:
            out[f"{name}_alone"] = _copies(bench, {name: copies[name]}, repeats, nbytes)[name]
        out["both_at_once"] = _copies(bench, copies, repeats, nbytes)
        matmul = _matmul_seconds(bench, a)
        seconds = repeats * nbytes / (1e9 * min(out["to_host_alone"], out["to_device_alone"]))
        count = max(2, math.ceil(seconds / matmul) + 2)
        beside = _copies(bench, copies, repeats, nbytes, compute=(a, count))
        out["beside_compute"] = beside
        flops = 2 * side**3
        out["matmul_tflops_alone"] = flops / matmul / 1e12
        out["matmul_tflops_beside_copies"] = beside.pop("compute_tflops")
        out["matmul"] = f"{count} x ({side} x {side}) @ ({side} x {side}), {bench.dtype}"
        out["predicted"] = dict(PREDICTED)
    return out


def _copies(
    bench: Bench,
    copies: dict[str, tuple[Any, Callable[[], Any]]],
    repeats: int,
    nbytes: int,
    *,
    compute: tuple[torch.Tensor, int] | None = None,
) -> dict[str, float]:
    """Each of ``copies`` ``repeats`` times on its own stream, all released together by
    one event (with ``compute``'s matmuls issued on the compute stream after them, if
    given): GB/s each, from the event its stream recorded as it began to the one after
    its last copy, so the host's issuing of the others is not counted; ``total``: every
    byte over the span from the first start to the last end."""
    module = bench.module
    current = module.current_stream(bench.device)
    go = module.Event(enable_timing=True)
    go.record(current)
    spans: dict[str, tuple[Any, Any]] = {}
    for name, (stream, copy) in copies.items():
        stream.wait_event(go)
        start, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
        start.record(stream)
        with module.stream(stream):
            for _ in range(repeats):
                copy()
        end.record(stream)
        spans[name] = (start, end)
    if compute is not None:
        a, count = compute
        compute_start = module.Event(enable_timing=True)
        compute_start.record(current)
        for _ in range(count):
            torch.mm(a, a)
        compute_end = module.Event(enable_timing=True)
        compute_end.record(current)
    bench.sync()
    out = {
        name: repeats * nbytes / (start.elapsed_time(end) * 1e-3) / 1e9
        for name, (start, end) in spans.items()
    }
    if len(spans) > 1:
        span = max(go.elapsed_time(end) for _, end in spans.values()) - min(
            go.elapsed_time(start) for start, _ in spans.values()
        )
        out["total"] = len(spans) * repeats * nbytes / (span * 1e-3) / 1e9
    if compute is not None:
        seconds = compute_start.elapsed_time(compute_end) * 1e-3
        out["compute_tflops"] = count * 2 * a.shape[0] ** 3 / seconds / 1e12
    return out


def _matmul_seconds(bench: Bench, a: torch.Tensor, count: int = 5) -> float:
    """Seconds of one ``a @ a`` on the compute stream (the mean of ``count``, after one)."""
    module = bench.module
    torch.mm(a, a)
    start, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
    start.record(module.current_stream(bench.device))
    for _ in range(count):
        torch.mm(a, a)
    end.record(module.current_stream(bench.device))
    bench.sync()
    return float(start.elapsed_time(end)) * 1e-3 / count
