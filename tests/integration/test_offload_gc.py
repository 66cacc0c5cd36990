"""OffloadActivations inside a garbage collection, in a fresh interpreter state
(forked from the torch-preloaded server: ``tests._fresh.run_py``)."""

from __future__ import annotations


def test_release_from_a_finalizer_inside_the_pool_never_blocks() -> None:
    """A garbage collection can run while the pool holds its lock and free host copies,
    whose finalizers release blocks: that must not wait for the lock."""
    script = """
import gc, torch, leakfree
ctx = leakfree.OffloadActivations(force_host_copy=True, min_offload_size=1)
ws = [torch.randn(8, requires_grad=True) for _ in range(20)]
class Holder: pass
gc.set_threshold(5, 1, 1)
for step in range(1500):
    with ctx:
        loss = sum((torch.randn(4, 8) * w).sum() for w in ws)
        dropped = sum((torch.randn(4, 8) * w).sum() for w in ws)
    h = Holder(); h.me = h; h.g = dropped
    del h, dropped
    loss.backward()
print('"ok"')
"""
    from tests._fresh import run_py

    assert run_py(script, timeout=120) == "ok"
