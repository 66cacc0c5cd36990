# ruff: noqa
# Stand-in for the Fast-LLM loss-logging code after the fix (LF003 must stay silent), in our
# own words. It imitates ServiceNow/Fast-LLM at commit d1652fbb (#486):
# fast_llm/layers/language_model/head.py and fast_llm/layers/language_model/loss/loss.py now
# append ``value.detach()`` / ``total_loss.detach()``; fast_llm/engine/schedule/runner.py as before.
# A data file for tests/test_scan_kept_losses.py: never imported.
import dataclasses

import torch


@dataclasses.dataclass
class StepContext:
    losses: dict | None = None


class HeadLoss(torch.nn.Module):
    def __init__(self, name, weight=1.0, register=True):
        super().__init__()
        self._name = name
        self._weight = weight
        self._register = register

    def forward_backward(self, logits, kwargs, losses=None, split=0):
        if losses is None and self._weight is None:
            return None, None
        loss, grad = self._forward_backward(logits, kwargs, losses, split)
        if self._register:
            self._record(self._name, loss, losses)
        return loss * self._weight, grad

    def _record(self, name, value, losses, op=None):
        if losses is None:
            return
        losses[name].append(value.detach())


class OutputHead(torch.nn.Module):
    def _head_loss(self, hidden, kwargs, losses=None):
        hidden = hidden.flatten(0, -2)
        if self._splits == 1:
            total_loss, hidden_grad = self._head_loss_partial(hidden, kwargs, losses)
        else:
            hidden_grad = torch.empty_like(hidden)
            partial_losses = []
            for index, chunk in enumerate(hidden.chunk(self._splits)):
                partial_loss, grad = self._head_loss_partial(chunk, kwargs, losses, index)
                if partial_loss is not None:
                    partial_losses.append(partial_loss)
            total_loss = torch.stack(partial_losses).sum() if partial_losses else None

        if losses is not None:
            losses[self._total_loss_name].append(total_loss.detach())

        return total_loss, hidden_grad


class Runner:
    def run_step(self, batches):
        context = StepContext(losses={name: [] for name in self._loss_names})
        for batch in batches:
            self._forward(context, batch)
        return {name: torch.stack(values).sum().item() for name, values in context.losses.items()}

    def _forward(self, context, batch):
        output = self._model(batch, losses=context.losses)
        output.backward()
