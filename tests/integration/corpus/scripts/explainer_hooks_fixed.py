"""Train a classifier and, after every step, explain a fixed probe batch with an LRP-style
explainer whose forward hooks keep each layer's input and output for the relevance rules."""

import sys

import torch
from torch import nn

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40


class Explainer:
    def __init__(self, model):
        self.model = model
        self.softmax = nn.Softmax(dim=-1)
        self.handles = []

    def _keep_io(self, module, inputs, output):
        module.input = inputs[0].clone().detach()
        module.output = output.clone().detach()

    def _add_hooks(self):
        for module in [*self.model, self.softmax]:
            self.handles.append(module.register_forward_hook(self._keep_io))

    def _clear_hooks(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for module in [*self.model, self.softmax]:
            del module.input, module.output

    def attribute(self, x, target):
        self._add_hooks()
        x = x.clone().requires_grad_()
        probs = self.softmax(self.model(x))
        (grad,) = torch.autograd.grad(probs[:, target].sum(), x)
        self._clear_hooks()
        return (grad * x).detach()


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
probe = torch.randn(32, 32)
reports = []
for step in range(STEPS):
    x, y = torch.randn(16, 32), torch.randint(0, 16, (16,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()

    explainer = Explainer(model)
    relevance = explainer.attribute(probe, target=3)
    top = relevance.abs().mean(0).topk(3).indices.tolist()
    reports.append({"step": step, "top_features": top, "explainer": explainer})
    if step % 20 == 0:
        print(f"step {step} loss {loss.item():.3f} top {top}")
print("done", STEPS, "reports", len(reports))
