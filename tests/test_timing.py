"""The accelerator timing model (tests/simdev/timing.py): CUDA's ordering, modelled.

Each test pins one rule of the model with hand-computed times; the last ones feed it the
simulated device's real launches (a matmul, a side-stream copy ordered by an event).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.simdev.timing import COMPUTE, TO_DEVICE, TO_HOST, Rates, Timeline, attach

#: round numbers: 1 TFLOP/s, 1 GB/s memory, 1 GB/s each way, no launch cost
UNIT = Rates("unit", flops=1e12, memory=1e9, to_host=1e9, to_device=1e9, launch=0.0, kernel_min=0.0)
GB = 10**9


def test_a_stream_runs_in_order_and_a_kernel_takes_its_longer_bound() -> None:
    t = Timeline(UNIT)
    a = t.kernel(0, flops=2e12, nbytes=GB)  # 2 s of compute, 1 s of memory: 2 s
    b = t.kernel(0, flops=0, nbytes=3 * GB)  # memory-bound: 3 s, after a
    assert (a.start, a.end, b.start, b.end) == (0.0, 2.0, 2.0, 5.0)
    assert t.end == 5.0 and t.busy(COMPUTE) == 5.0


def test_copies_overlap_compute_and_each_other_across_directions() -> None:
    t = Timeline(UNIT)
    k = t.kernel(0, flops=4e12, nbytes=0)  # 4 s
    out = t.copy(1, 2 * GB, TO_HOST)  # another stream, its own engine: at once
    back = t.copy(2, 3 * GB, TO_DEVICE)  # the other direction: at once too (full duplex)
    assert (k.start, out.start, back.start) == (0.0, 0.0, 0.0)
    assert t.end == 4.0
    assert t.overlap(TO_HOST, TO_DEVICE) == 2.0 and t.overlap(COMPUTE, TO_HOST) == 2.0


def test_copies_of_one_direction_share_one_engine() -> None:
    t = Timeline(UNIT)
    first = t.copy(1, GB, TO_HOST)
    second = t.copy(2, GB, TO_HOST)  # another stream, same direction: after the first
    assert (first.end, second.start, second.end) == (1.0, 1.0, 2.0)


def test_an_event_orders_another_stream_and_only_what_is_issued_after_the_wait() -> None:
    t = Timeline(UNIT)
    early = t.copy(1, GB, TO_HOST)  # issued before the wait: not held back
    t.kernel(0, flops=3e12, nbytes=0)  # 3 s
    t.record(event=7, stream=0)
    t.wait(stream=1, event=7)
    late = t.copy(1, GB, TO_HOST)
    assert early.start == 0.0 and late.start == 3.0 and late.end == 4.0


def test_the_host_waits_where_it_synchronizes_and_pays_each_launch() -> None:
    rates = Rates("slow host", 1e12, 1e9, 1e9, 1e9, launch=1.0, kernel_min=0.0)
    t = Timeline(rates)
    t.kernel(0, flops=5e12, nbytes=0)  # issued at 1 s, ends at 6 s
    t.sync_stream(0)
    after = t.kernel(0, flops=1e12, nbytes=0)  # issued at 6 + 1 s
    assert (after.start, after.end) == (7.0, 8.0)
    tiny = Timeline(rates)
    for _ in range(4):
        tiny.kernel(0, flops=1.0, nbytes=0)  # launch-bound: the host is the bottleneck
    assert tiny.end == pytest.approx(4.0, abs=1e-6)


def test_a_half_duplex_link_runs_one_direction_at_a_time() -> None:
    half = Rates("half", 1e12, 1e9, 1e9, 1e9, launch=0.0, kernel_min=0.0, duplex=0.0)
    t = Timeline(half)
    out = t.copy(1, 2 * GB, TO_HOST)  # 0-2 s
    back = t.copy(2, GB, TO_DEVICE)  # issued at once: waits for the link
    assert (out.end, back.start, back.end) == (2.0, 0.0, 3.0)
    assert Timeline(UNIT).copy(2, GB, TO_DEVICE).end == 1.0  # full duplex: no wait


def test_a_slow_second_direction_gets_its_share_while_the_first_runs() -> None:
    slow = Rates("44%", 1e12, 1e9, 1e9, 1e9, launch=0.0, kernel_min=0.0, duplex=0.44)
    t = Timeline(slow)
    t.copy(1, GB, TO_HOST)  # 0-1 s, alone
    back = t.copy(2, GB, TO_DEVICE)  # 0.44 GB by 1 s, the rest at full rate
    assert back.end == pytest.approx(1.56)
    later = t.copy(2, GB, TO_DEVICE)  # nothing the other way: its full rate
    assert later.seconds == pytest.approx(1.0)


def test_a_copy_names_its_direction() -> None:
    with pytest.raises(ValueError, match="engine='sideways'"):
        Timeline(UNIT).copy(0, 1, "sideways")


# --- fed by the simulated device -----------------------------------------------------------


def test_the_simulated_device_feeds_kernels_copies_and_events(sim: Any) -> None:
    a = torch.randn(64, 32, device=sim.device)
    b = torch.randn(32, 16, device=sim.device)
    side = sim.module.Stream()
    host = torch.empty(64, 16, pin_memory=True)
    with attach(UNIT) as t:
        c = a @ b
        done = sim.module.Event()
        done.record()
        side.wait_event(done)
        with sim.module.stream(side):
            host.copy_(c, non_blocking=True)
            c.record_stream(side)
        d = a @ b  # on the default stream again: not ordered after the copy
        side.synchronize()
    mm = [op for op in t.ops if op.name.startswith("aten::mm")]
    assert [op.flops for op in mm] == [2 * 64 * 32 * 16] * 2  # torch's own FLOP formula
    (copy,) = [op for op in t.ops if op.engine == TO_HOST]
    assert copy.nbytes == 64 * 16 * 4 and copy.stream == side.stream_id
    assert copy.start >= mm[0].end  # the event ordered it after the first matmul
    assert t.host >= copy.end  # the host waited for the side stream
    assert torch.equal(host, (a @ b).cpu()) and torch.equal(d.cpu(), host)


def test_a_dry_step_models_a_full_size_step_in_a_fraction_of_its_memory(sim: Any) -> None:
    # dry mode: results shaped on the meta device, nothing computed or copied; the model
    # still sees every launch, with its FLOPs and bytes, and leakfree's offloader runs as is
    import leakfree

    sim.dry = True
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).to(sim.device)
    x = torch.empty(2048, 1024, device=sim.device)

    def step(offload: bool) -> Timeline:
        with attach(UNIT) as t:
            with leakfree.OffloadActivations(min_offload_size=1) if offload else _nothing():
                loss = model(x).sum()
            loss.backward()
            sim.module.synchronize()
        return t

    plain, offloaded = step(False), step(True)
    flops = sum(op.flops for op in plain.ops)
    # 4 forward matmuls, 4 for the weights' gradients, 3 for the inputs' (x needs none)
    assert flops == pytest.approx(11 * 2 * 2048 * 1024 * 1024, rel=0.01)
    assert plain.busy(TO_HOST) == 0 and offloaded.busy(TO_HOST) > 0
    assert offloaded.busy(TO_DEVICE) > 0 and offloaded.end > plain.end


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
