# ruff: noqa
# Stand-in for the LF005 scan rule (data file: never imported).
# The fixed shape of leaf_recv_leaky.py, as docs/pipeline.md and
# examples/pipeline_two_stages.py do it: each received buffer becomes a non-leaf alias
# (leakfree.pipeline.as_nonleaf) whose backward hands the gradient to a GradSlot; the
# input gradient is taken from the slot, and no .grad is ever set.
import torch
import torch.distributed as dist
from leakfree import pipeline


def run_stage(stage, shape, num_microbatches, prev_rank, next_rank, loss_fn, device):
    slots = []
    outputs = []
    for i in range(num_microbatches):
        buf = torch.empty(shape, device=device)
        dist.recv(buf, src=prev_rank)
        slot = pipeline.GradSlot()
        x = pipeline.as_nonleaf(buf, slot)
        slots.append(slot)
        outputs.append(stage(x))
    for i in range(num_microbatches):
        loss = loss_fn(outputs.pop(0), i)
        loss.backward()
        dist.send(slots.pop(0).take(), dst=prev_rank)


class Stage:
    """The same, split across methods, with batched irecv ops and a helper."""

    def __init__(self, module, shape, prev_rank):
        self.module = module
        self.shape = shape
        self.prev_rank = prev_rank
        self.slots = []
        self.output_tensors = []

    def forward_all(self, num_microbatches):
        for _ in range(num_microbatches):
            recv_buf = torch.zeros(self.shape)
            ops = [dist.P2POp(dist.irecv, recv_buf, self.prev_rank)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            slot = pipeline.GradSlot()
            self.slots.append(slot)
            self.output_tensors.append(self.module(pipeline.as_nonleaf(recv_buf, slot)))

    def backward_one(self, grad_output):
        slot = self.slots.pop(0)
        y = self.output_tensors.pop(0)
        torch.autograd.backward(y, grad_tensors=grad_output)
        send_grad(slot, self.prev_rank)


def send_grad(slot, dst):
    dist.send(slot.take(), dst=dst)
