"""Pipeline parallelism: ``torch.distributed.pipelining`` first, and primitives for your own.

**With ``torch.distributed.pipelining``** (the supported path): call
``leakfree.patch_all()``. From torch 2.13 it repairs what the stages keep longer than a
microbatch: the persistent receive buffer handed to the stage as its input (hooks pile up
on it), sent outputs kept until their backward, one receive buffer per microbatch for the
run, the step's state kept until the next step (:mod:`leakfree.patches.pipelining`, built
on :func:`as_nonleaf` and :func:`release_output`'s storage swap; docs/pipeline.md has the
bytes). No release grows per step. What a schedule hands back through ``losses=`` is each
microbatch's loss with its graph: pass a :class:`PipelineLosses` to keep only detached
losses (optionally forwarded to a :class:`leakfree.LossLog`, across steps).

**Writing your own send / receive**: a stage receives an activation into a buffer, runs
forward on it, and later sends the buffer's gradient back. The usual way makes the buffer
an autograd *leaf* (``buf.requires_grad_()``): its gradient then accumulates in
``buf.grad`` (kept until someone clears it), reused buffers collect tensor hooks across
steps, every microbatch gets its own buffer for the whole run, and in one C++ framework
the leaf and its accumulation node formed a reference cycle that kept every step's graph
alive. Here the received activation is a *non-leaf* alias of the buffer, made by
:func:`as_nonleaf`: its backward hands the gradient to a :class:`GradSlot` and returns
nothing, so there is no accumulation node for the buffer and no ``.grad`` anywhere.
``examples/pipeline_two_stages.py`` wires them into GPipe / 1F1B.

Lifetime contract
-----------------
*A receive buffer* is kept by its non-leaf activation and by whatever saved that for
backward. :class:`RecvBufferPool` takes it back once, at the first of: its slot delivered
(the stage's backward through it is complete), its graph was dropped. So a buffer still
needed by backward is never overwritten; free buffers stay with the pool until the pool
is dropped (no trim), and a buffer in use keeps its pool alive until it returns.
*The received gradient* is kept by the :class:`GradSlot` until ``take()`` (or passed
straight to its ``callback``); autograd keeps nothing, and the slot leaves the node's
``ctx`` after that node's backward.
*A sent output's storage* is freed by :func:`release_output` once the send completed
(unless something else still references it: then a :class:`PipelineWarning`, and it
stays until that holder lets go). The returned :class:`ReleasedOutput` keeps only the
graph, through its gradient edge, until the handle is dropped; :func:`backward_from`
runs that graph's backward, which frees its saved tensors as any backward does.
*A send in flight* (``isend``) keeps its header and a contiguous alias of its data in a
:class:`PendingSends`, until ``poll()`` or ``wait_all()`` finishes it; the alias is
dropped before the send's callback (typically the release) runs.
*Pipeline losses*: a :class:`PipelineLosses` keeps one step's losses, detached, until
the schedule clears it at the next step; its log (if any) keeps them until reduced.

Layout
------
``slots`` (:class:`GradSlot`, :func:`as_nonleaf`), ``buffers`` (:class:`RecvBufferPool`),
``release`` (:func:`release_output`, :func:`backward_from`), ``p2p`` (send / receive with
headers, :class:`PendingSends`, aborts and timeouts), ``losses``
(:class:`PipelineLosses`).
"""

from leakfree.pipeline.buffers import RecvBufferPool
from leakfree.pipeline.p2p import (
    PipelineAborted,
    PipelineTimeout,
    recv_backward,
    recv_forward,
    send_abort,
    send_backward,
    send_forward,
)
from leakfree.pipeline.release import PipelineWarning, backward_from, release_output
from leakfree.pipeline.schedule_losses import PipelineLosses
from leakfree.pipeline.slots import GradSlot, as_nonleaf

__all__ = [
    "GradSlot",
    "PipelineAborted",
    "PipelineLosses",
    "PipelineTimeout",
    "PipelineWarning",
    "RecvBufferPool",
    "as_nonleaf",
    "backward_from",
    "recv_backward",
    "recv_forward",
    "release_output",
    "send_abort",
    "send_backward",
    "send_forward",
]
