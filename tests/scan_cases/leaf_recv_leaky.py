# ruff: noqa
# Stand-in for the LF005 scan rule (data file: never imported).
# A hand-written GPipe pipeline stage, the way such stages are usually written (the leak
# docs/pipeline.md describes under "Your own send / receive"): every microbatch receives
# into a fresh buffer, made an autograd leaf with requires_grad_() as
# torch/distributed/pipelining/stage.py (torch 2.13) does for its receive buffers, and the
# input gradient is read back from the leaf's .grad after backward.
import torch
import torch.distributed as dist


def run_stage(stage, shape, num_microbatches, prev_rank, next_rank, loss_fn, device):
    inputs = []
    outputs = []
    for i in range(num_microbatches):
        buf = torch.empty(shape, device=device)
        dist.recv(buf, src=prev_rank)
        x = buf.requires_grad_()
        inputs.append(x)
        outputs.append(stage(x))
    for i in range(num_microbatches):
        x = inputs.pop(0)
        loss = loss_fn(outputs.pop(0), i)
        loss.backward()
        dist.send(x.grad, dst=prev_rank)


class Stage:
    """The same, split across methods, with batched irecv ops and a helper."""

    def __init__(self, module, shape, prev_rank):
        self.module = module
        self.shape = shape
        self.prev_rank = prev_rank
        self.input_tensors = []
        self.output_tensors = []

    def forward_all(self, num_microbatches):
        for _ in range(num_microbatches):
            recv_buf = torch.zeros(self.shape, requires_grad=True)
            ops = [dist.P2POp(dist.irecv, recv_buf, self.prev_rank)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            self.input_tensors.append(recv_buf)
            self.output_tensors.append(self.module(recv_buf))

    def backward_one(self, grad_output):
        x = self.input_tensors.pop(0)
        y = self.output_tensors.pop(0)
        torch.autograd.backward(y, grad_tensors=grad_output)
        send_grad(x, self.prev_rank)


def send_grad(input_tensor, dst):
    dist.send(input_tensor.grad, dst=dst)
