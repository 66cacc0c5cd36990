"""OffloadActivations inside a garbage collection, in a fresh interpreter."""

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
print("ok")
"""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
