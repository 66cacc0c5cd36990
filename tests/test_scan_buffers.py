"""LF005 (leakfree.scan.rules.buffers): receive buffers made autograd leaves in a loop."""

from __future__ import annotations

import textwrap

import pytest

from leakfree.scan._model import ScanFinding
from leakfree.scan.rules.buffers import RULES
from tests._scan import CASES, line_of, project_of, source

(RULE,) = RULES


def scan(text: str, *others: tuple[str, str]) -> list[ScanFinding]:
    src = source("case.py", text)
    return list(RULE.check(src, project_of(src, *(source(p, t) for p, t in others))))


def test_leaf_receive_flagged() -> None:
    text = (CASES / "leaf_recv_leaky.py").read_text()
    found = scan(text)
    assert [(f.rule, f.line, f.symbol) for f in found] == [
        ("LF005", line_of(text, "x = buf.requires_grad_()"), "x.grad"),
        (
            "LF005",
            line_of(text, "recv_buf = torch.zeros(self.shape, requires_grad=True)"),
            "recv_buf.grad",
        ),
    ]
    assert "leakfree.pipeline.as_nonleaf" in found[0].message
    assert RULE.confirm == "leakfree.diagnostics.find_retained"


def test_nonleaf_receive_silent() -> None:
    assert scan((CASES / "leaf_recv_fixed.py").read_text()) == []


def test_receive_call_alias_and_while_loop() -> None:
    found = scan(
        """
        def stage(comm, n, module):
            grads = []
            i = 0
            while i < n:
                act = comm.recv_activation(i)
                x = act.detach()
                x.requires_grad = True
                module(x).sum().backward()
                grads.append(x.grad)
                i += 1
            return grads
        """
    )
    assert [(f.line, f.symbol) for f in found] == [(8, "x.grad")]


def test_grad_read_in_helper_in_another_file() -> None:
    helper = """
    def backward_step(input_tensor, output_tensor, grad):
        output_tensor.backward(grad)
        return input_tensor.grad
    """
    found = scan(
        """
        import torch
        import torch.distributed as dist

        def run(n, shape, module, prev):
            pending = []
            for _ in range(n):
                buf = torch.empty(shape)
                work = dist.irecv(tensor=buf, src=prev)
                work.wait()
                x = buf.detach().requires_grad_(True)
                pending.append((x, module(x)))
            for x, y in pending:
                dist.send(backward_step(x, y, None), prev)
        """,
        ("schedule.py", helper),
    )
    assert [(f.line, f.symbol) for f in found] == [(11, "x.grad")]


def test_leaf_made_by_helper_in_the_loop() -> None:
    # The Megatron-derived shape (FlashFlex hexiscale/heterogeneous_pipeline.py, 2025):
    # the loop receives, a forward_step helper sets requires_grad on what it is given,
    # and a backward_step helper reads .grad of what comes out of the stage's list.
    found = scan(
        """
        class Pipeline:
            def __init__(self):
                self.input_tensors = []

            def run_forward(self, n):
                for i in range(n):
                    input_tensor = self.recv_forward(self.shape)
                    output = self.forward_step(self.model, input_tensor)
                    self.input_tensors.append(input_tensor)

            def run_backward(self, n):
                for i in range(n):
                    x = self.input_tensors.pop(0)
                    self.send_backward(self.backward_step(x))

            def forward_step(self, model, inputs):
                if not isinstance(inputs, list):
                    inputs = [inputs]
                for x in inputs:
                    x.requires_grad = True
                return model(*inputs)

            def backward_step(self, inputs):
                return [x.grad for x in inputs]
        """
    )
    assert [(f.line, f.symbol) for f in found] == [(9, "input_tensor.grad")]


def test_receive_helper_makes_the_leaf() -> None:
    # The Megatron-LM shape (core/pipeline_parallel: schedules.py, p2p_communication.py):
    # the receive helper allocates its buffers with requires_grad=True (in a nested
    # factory), the schedule's loop receives, and backward reaches the .grad read through
    # a local alias of the backward function.
    p2p = """
    import torch

    class Communicator:
        def _communicate(self, shape, recv_prev):
            def create_tensor_recv_prev():
                return torch.empty(shape, requires_grad=True)
            buf = create_tensor_recv_prev() if recv_prev else None
            self._irecv(buf)
            return buf

        def recv_forward(self, shape):
            return self._communicate(shape, recv_prev=True)
    """
    found = scan(
        """
        import functools

        def backward_step(input_tensor, output_tensor, grad, config):
            if not isinstance(input_tensor, list):
                input_tensor = [input_tensor]
            output_tensor.backward(grad)
            return [x.grad for x in input_tensor]

        def pipelining(comm, shape, n, forward, config):
            backward_func = functools.partial(backward_step) if config.multi else backward_step
            backward_func = backward_step
            input_tensors, output_tensors = [], []
            for i in range(n):
                input_tensor = comm.recv_forward(shape)
                output_tensors.append(forward(input_tensor))
                input_tensors.append(input_tensor)
            for i in range(n):
                grad = backward_func(input_tensors.pop(0), output_tensors.pop(0), None, config)
                comm.send_backward(grad)
        """,
        ("p2p_communication.py", p2p),
    )
    assert [(f.line, f.symbol) for f in found] == [(15, "input_tensor.grad")]


def test_one_finding_per_buffer_and_loop() -> None:
    found = scan(
        """
        import torch
        import torch.distributed as dist

        def forward_step(func, data, model, n, input_tensor):
            input_tensor.requires_grad_()
            return model(input_tensor)

        def run(n, shape, model, prev):
            inputs = []
            for i in range(n):
                buf = torch.empty(shape, requires_grad=True)
                dist.recv(buf, prev)
                buf.requires_grad_()  # the same buffer again: not a second finding
                forward_step(None, None, model, n, buf)
                inputs.append(buf)
            return [t.grad for t in inputs]
        """
    )
    assert [(f.line, f.symbol) for f in found] == [(12, "buf.grad")]


SILENT = {
    "leaf made once, outside any loop": """
        def once(shape, n, module, prev):
            buf = torch.empty(shape)
            dist.recv(buf, prev)
            buf.requires_grad_()
            for _ in range(n):
                module(buf).sum().backward()
            return buf.grad
    """,
    "no .grad read (autograd.grad)": """
        def no_grad_read(shape, n, module, prev):
            out = []
            for _ in range(n):
                buf = torch.empty(shape)
                dist.recv(buf, prev)
                x = buf.requires_grad_()
                (g,) = torch.autograd.grad(module(x).sum(), inputs=x)
                out.append(g)
            return out
    """,
    "a leaf, but nothing received": """
        def not_received(n, module):
            for _ in range(n):
                w = torch.randn(4, 4).requires_grad_()
                module(w).sum().backward()
                print(w.grad)
    """,
    "requires_grad_(False)": """
        def switched_off(shape, n, module, prev):
            for _ in range(n):
                buf = torch.empty(shape)
                dist.recv(buf, prev)
                x = buf.requires_grad_(False)
                module(x)
                print(x.grad)
    """,
    "a bare call does not reach a method of that name": """
        class Other:
            def forward_step(self, model, x):
                x.requires_grad_()

        def forward_step(model, x):
            return model(x)

        def run(shape, n, module, prev):
            out = []
            for _ in range(n):
                buf = torch.empty(shape)
                dist.recv(buf, prev)
                forward_step(module, buf)
                out.append(buf)
            return [t.grad for t in out]
    """,
    "receive ops, not tensors": """
        def ops_not_tensors(stage, n):
            for i in range(n):
                ops = stage.get_fwd_recv_ops(i)
                ops.requires_grad_()
                print(ops.grad)
    """,
}


@pytest.mark.parametrize("case", SILENT, ids=list(SILENT))
def test_not_this_shape_silent(case: str) -> None:
    header = "import torch\nimport torch.distributed as dist\n"
    assert scan(header + textwrap.dedent(SILENT[case])) == []
