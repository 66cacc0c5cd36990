"""The simulated device's caching allocator (tests/simdev/allocator.py) against CUDA's rules.

The expected numbers are worked out by hand from the rules of PyTorch's
``CUDACachingAllocator`` (rounding to 512 B; 2 MiB small segments; 20 MiB large segments
under 10 MiB, else rounded to 2 MiB; best fit within the stream's pool; split when the
rest is >= 512 B small, > 1 MiB large), never read back from the model. The first tests
drive the allocator alone (integers); the rest drive the simulated device with tensors,
streams, the timing model and ``torch.accelerator``.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from tests.simdev import allocator as alloc
from tests.simdev.allocator import CachingAllocator, MiB
from tests.simdev.fragmentation import growing_steps
from tests.simdev.timing import Rates, attach

KiB = 1 << 10


class Done:
    """Streams whose work has ended, as the test says (the allocator's view of a device)."""

    def __init__(self) -> None:
        self.busy: set[int] = set()
        self.waited: list[int] = []

    def record(self, stream: int) -> int:
        return stream

    def query(self, stream: int) -> bool:
        return stream not in self.busy

    def synchronize(self, stream: int) -> None:
        self.waited.append(stream)
        self.busy.discard(stream)


def stat(a: CachingAllocator, key: str) -> int:
    return a.memory_stats()[key]


SPLIT_LARGE = "inactive_split_bytes.large_pool.current"


def test_rounding_pools_best_fit_split_and_merge_by_hand() -> None:
    a = CachingAllocator(Done())
    tiny = a.malloc(1000, 0)  # 1024 B of a new 2 MiB small segment, the rest split off
    assert (a.allocated, a.reserved) == (1024, 2 * MiB)
    assert stat(a, "inactive_split_bytes.small_pool.current") == 2 * MiB - 1024
    assert stat(a, "requested_bytes.all.current") == 1000
    b = a.malloc(3 * MiB, 0)  # under 10 MiB: a 20 MiB segment, 17 MiB split off
    assert a.reserved == 22 * MiB and stat(a, SPLIT_LARGE) == 17 * MiB
    c = a.malloc(25 * MiB // 2, 0)  # 12.5 MiB: best fit is the 17 MiB rest, no new segment
    assert a.reserved == 22 * MiB
    d = a.malloc(4 * MiB, 0)  # the 4.5 MiB rest: 0.5 MiB left is not > 1 MiB, handed whole
    assert a.allocated == 1024 + 3 * MiB + 25 * MiB // 2 + 9 * MiB // 2
    assert stat(a, SPLIT_LARGE) == 0 and stat(a, "inactive_split.all.current") == 1
    a.free(b)  # its neighbour c is allocated: no merge, 3 MiB inactive in a split segment
    assert stat(a, SPLIT_LARGE) == 3 * MiB
    a.free(c)  # merges with b: 15.5 MiB, one inactive block
    assert stat(a, SPLIT_LARGE) == 31 * MiB // 2
    assert stat(a, "inactive_split.large_pool.current") == 1
    a.free(d)  # merges back into the whole 20 MiB segment: not split any more
    assert stat(a, SPLIT_LARGE) == 0 and stat(a, "segment.all.current") == 2
    assert (a.allocated, a.reserved) == (1024, 22 * MiB)
    assert (a.max_allocated, a.max_reserved) == (1024 + 20 * MiB, 22 * MiB)
    a.empty_cache()  # the large segment goes; the small one holds `tiny`
    assert (a.allocated, a.reserved) == (1024, 2 * MiB)
    assert stat(a, "num_device_alloc") == 2 and stat(a, "num_device_free") == 1
    assert stat(a, "allocation.all.allocated") == 4
    a.reset_peaks()
    assert (a.max_allocated, a.max_reserved) == (1024, 2 * MiB)
    a.check([tiny])


def test_a_block_is_reused_only_on_the_stream_it_was_allocated_on() -> None:
    a = CachingAllocator(Done())
    a.free(a.malloc(12 * MiB, 0))  # cached in stream 0's pool
    other = a.malloc(12 * MiB, 1)  # stream 1 cannot have it: a new segment
    assert a.reserved == 24 * MiB
    same = a.malloc(12 * MiB, 0)  # stream 0 can
    assert a.reserved == 24 * MiB
    a.check([other, same])


def test_a_block_recorded_on_a_busy_stream_waits_for_it_then_is_reused() -> None:
    done = Done()
    a = CachingAllocator(done)
    x = a.malloc(12 * MiB, 0)
    a.record_stream(x, 7)  # a copy on stream 7 reads it
    a.record_stream(x, 0)  # its own stream: nothing to wait for
    done.busy.add(7)
    a.free(x)
    assert a.allocated == 0  # gone from the allocated count at once...
    assert stat(a, "active_bytes.all.current") == 12 * MiB  # ...but still in use
    y = a.malloc(12 * MiB, 0)  # so not reusable: a new segment
    assert a.reserved == 24 * MiB
    a.free(y)
    done.busy.clear()  # stream 7 passed the point of the free
    z = a.malloc(12 * MiB, 0)
    w = a.malloc(12 * MiB, 0)  # both cached blocks served: nothing new
    assert a.reserved == 24 * MiB and stat(a, "active_bytes.all.current") == 24 * MiB
    a.check([z, w])


def test_the_cap_raises_only_after_the_cache_was_released_and_the_retry_failed() -> None:
    done = Done()
    a = CachingAllocator(done)
    a.limit = 40 * MiB
    kept = a.malloc(24 * MiB, 1)
    cached = a.malloc(12 * MiB, 0)
    a.record_stream(cached, 5)
    done.busy.add(5)
    a.free(cached)  # pending on stream 5: neither usable nor releasable yet
    assert a.reserved == 36 * MiB
    with pytest.raises(torch.OutOfMemoryError) as raised:
        a.malloc(20 * MiB, 0)  # 36 + 20 > 40: wait, release the 12 MiB, retry: 24 + 20 > 40
    assert done.waited == [5]  # the pending free was waited for before releasing
    assert a.reserved == 24 * MiB  # released before raising
    message = str(raised.value)
    for part in (
        "Tried to allocate 20.00 MiB",
        "total capacity of 80.00 GiB of which 79.98 GiB is free",
        "40.00 MiB allowed",
        "24.00 MiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated",
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    ):
        assert part in message, (part, message)
    assert stat(a, "num_alloc_retries") == 1 and stat(a, "num_ooms") == 1
    fits = a.malloc(16 * MiB, 0)  # 24 + 16 = 40: at the cap is allowed
    assert a.reserved == 40 * MiB
    a.check([kept, fits])


def test_the_retry_serves_what_the_cache_was_blocking() -> None:
    a = CachingAllocator(Done(), capacity=64 * MiB)
    a.free(a.malloc(40 * MiB, 0))  # cached on stream 0
    x = a.malloc(40 * MiB, 1)  # 80 > 64: the cached segment is released, the retry fits
    assert a.reserved == 40 * MiB
    assert stat(a, "num_alloc_retries") == 1 and stat(a, "num_ooms") == 0
    assert stat(a, "num_device_free") == 1
    a.check([x])


def test_statistics_stay_consistent_over_a_random_sequence() -> None:
    rng = random.Random(0)
    done = Done()
    a = CachingAllocator(done, capacity=512 * MiB)
    live: list[alloc.Block] = []
    sizes = (1, 700, 4 * KiB, 1 * MiB, MiB + 1, 3 * MiB, 11 * MiB, 30 * MiB)
    for _ in range(400):
        r = rng.random()
        if r < 0.5 or not live:
            try:
                live.append(a.malloc(rng.choice(sizes), rng.choice((0, 0, 3))))
            except torch.OutOfMemoryError:
                a.empty_cache()
        elif r < 0.9:
            block = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.3:
                a.record_stream(block, 9)
                done.busy.add(9)
            a.free(block)
        elif r < 0.95:
            done.busy.clear()
        else:
            a.empty_cache()
        a.check(live)
        assert a.reserved >= a.allocated and a.max_reserved >= a.max_allocated


def test_the_cap_is_a_fraction_of_the_capacity_and_named_when_wrong() -> None:
    a = CachingAllocator(Done(), capacity=100 * MiB)
    a.set_memory_fraction(0.5)
    assert a.limit == 50 * MiB
    with pytest.raises(ValueError, match=r"set_per_process_memory_fraction\(fraction=1.5\)"):
        a.set_memory_fraction(1.5)
    assert a.limit == 50 * MiB


# --- on the simulated device ---------------------------------------------------------------


def mib(n: float, device: Any) -> torch.Tensor:
    return torch.empty(int(n * MiB), dtype=torch.uint8, device=device)


def test_the_device_allocates_through_it_and_reports_as_torch_cuda(sim: Any) -> None:
    m = sim.module
    base_allocated, base_reserved = m.memory_allocated(), m.memory_reserved()
    assert (base_allocated, base_reserved) == (0, 0)
    x = torch.empty(10, device=sim.device)  # 40 B: 512 B of a 2 MiB segment
    assert (m.memory_allocated(), m.memory_reserved()) == (512, 2 * MiB)
    assert torch.accelerator.memory_allocated() == 512  # torch.accelerator sees it too
    assert torch.accelerator.memory_stats()["reserved_bytes.all.current"] == 2 * MiB
    del x
    assert (m.memory_allocated(), m.max_memory_allocated()) == (0, 512)
    m.empty_cache()
    assert m.memory_reserved() == 0 and m.max_memory_reserved() == 2 * MiB
    m.reset_peak_memory_stats()
    assert (m.max_memory_allocated(), m.max_memory_reserved()) == (0, 0)
    sim.capacity = 1 << 30
    assert m.get_device_properties().total_memory == 1 << 30
    y = mib(12, sim.device)
    assert m.mem_get_info() == ((1 << 30) - 12 * MiB, 1 << 30)
    assert torch.accelerator.get_memory_info() == m.mem_get_info()
    m.set_per_process_memory_fraction(0.25)
    assert sim.limit == 256 * MiB
    del y


def test_a_side_stream_copy_holds_its_block_until_the_host_sees_it_end(sim: Any) -> None:
    sim.lazy = True  # a slow device: the side stream's work ends when the host waits for it
    side = sim.module.Stream()
    x = mib(12, sim.device)
    host = torch.empty(12 * MiB, dtype=torch.uint8, pin_memory=True)
    side.wait_stream(sim.module.current_stream())
    with sim.module.stream(side):
        host.copy_(x, non_blocking=True)
    x.record_stream(side)
    del x
    y = mib(12, sim.device)  # x's block is still read by the copy: a new segment
    assert sim.reserved() == 24 * MiB and sim.allocated() == 12 * MiB
    side.synchronize()
    z = mib(12, sim.device)  # the copy is over: x's block serves it
    assert sim.reserved() == 24 * MiB
    del y, z


def test_with_the_timing_model_the_block_waits_for_the_copy_by_the_hosts_clock(sim: Any) -> None:
    slow = Rates("slow link", flops=1e12, memory=1e12, to_host=12 * MiB, to_device=12 * MiB,
                 launch=1e-6, kernel_min=0.0)  # fmt: skip
    side = sim.module.Stream()
    host = torch.empty(12 * MiB, dtype=torch.uint8, pin_memory=True)
    x = mib(12, sim.device)
    with attach(slow) as t:
        side.wait_stream(sim.module.current_stream())
        with sim.module.stream(side):
            host.copy_(x, non_blocking=True)  # one second of copy
        done = side.record_event()
        x.record_stream(side)
        del x
        y = mib(12, sim.device)  # a microsecond later by the host's clock: held
        assert t.reserved == 24 * MiB and t.held_peak == 24 * MiB
        done.synchronize()  # the host waits a second
        z = mib(12, sim.device)
        assert t.reserved == 24 * MiB and t.peak == 24 * MiB
        del y, z
        sim.module.empty_cache()
        sim.module.reset_peak_memory_stats()  # the program's reset is not the timeline's
        assert sim.held_peak() == 0 and (t.reserved, t.held_peak) == (0, 24 * MiB)


def test_under_a_cap_the_device_raises_out_of_memory_naming_the_sizes(sim: Any) -> None:
    sim.limit = 40 * MiB
    kept = mib(24, sim.device)
    mib(12, sim.device)  # freed at once: cached
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 20.00 MiB"):
        mib(20, sim.device)
    assert sim.reserved() == 24 * MiB  # the cache went before the error
    assert sim.module.memory_stats()["num_ooms"] == 1
    del kept


def test_empty_cache_returns_what_no_tensor_uses(sim: Any) -> None:
    kept = torch.empty(100, device=sim.device)  # splits a small segment: not releasable
    alive = [mib(n, sim.device) for n in (12, 30, 3)]  # 3 MiB: a 20 MiB segment
    assert sim.reserved() == 2 * MiB + 12 * MiB + 30 * MiB + 20 * MiB
    del alive
    assert (sim.reserved(), sim.allocated()) == (64 * MiB, 512)  # cached, not returned
    sim.module.empty_cache()
    assert (sim.reserved(), sim.allocated()) == (2 * MiB, 512)
    del kept


def test_growing_shapes_fragment_the_cache_while_nothing_leaks(sim: Any) -> None:
    pattern = growing_steps(sim.device, 6)
    steps = [next(pattern) for _ in range(6)]
    # by hand: step i reserves a (20 + 2i) MiB segment; step 0 also a 20 MiB one for the
    # kept 1.5 MiB, which later steps' kept tensors find in the cache
    assert [s.allocated for s in steps] == [3 * MiB // 2] * 6
    assert [s.reserved for s in steps] == [
        (20 + 20 + sum(20 + 2 * j for j in range(1, i + 1))) * MiB for i in range(6)
    ]
    assert all(s.inactive_split == 37 * MiB // 2 for s in steps)
    sim.module.empty_cache()  # all of it comes back but the kept tensor's segment
    assert (sim.reserved(), sim.allocated()) == (20 * MiB, 3 * MiB // 2)
    pattern.close()  # the kept tensor goes with the steps
    sim.module.empty_cache()
    assert (sim.reserved(), sim.allocated()) == (0, 0)
