# ruff: noqa
# The fixed twins of loss_logging_leaky.py plus nearby code LF003 must leave alone (detached
# values, metadata, local lists, no_grad, LossLog, caches that feed backward). Never imported.
import leakfree
import torch
import torch.nn.functional as F

LOSS_HISTORY = []


class Trainer:
    def __init__(self, model, criterion):
        self.model = model
        self.criterion = criterion
        self.history = []
        self.losses = {}
        self.metrics = {"logits": []}
        self.total_loss = 0.0
        self.total = 0.0
        self.state = None
        self.log = leakfree.LossLog(["ce"])

    def train_step(self, batch):
        logits = self.model(batch["x"])
        loss = self.criterion(logits, batch["y"])
        loss.backward()
        self.history.append(loss.detach())
        self.losses["ce"] = loss.item()
        self.total_loss += loss.detach()
        self.total = self.total + float(loss)
        self.metrics["logits"].append(logits.detach().cpu())
        self.state.log_history.append({"loss": loss.cpu().item(), "step": 1})
        LOSS_HISTORY.append(loss.tolist())
        self.log["ce"].append(loss)  # LossLog detaches by itself
        self.last_loss = loss  # one step's graph, replaced next step: not flagged
        self.history.append(loss.shape)
        self.history.append(logits.size(0))

    def step_with_alias(self, x, y):
        out = self.model(x)
        ce = F.cross_entropy(out, y)
        ce = ce.detach()
        hist = self.history
        hist.append(ce * 2)

    def step_local(self, batches):
        step_losses = []
        for batch in batches:
            step_losses.append(self.model(batch).loss)
        total = torch.stack(step_losses).sum()
        total.backward()
        return total

    @torch.no_grad()
    def evaluate_batch(self, batch):
        loss = self.model(batch).loss
        self.history.append(loss)

    def eval_loop(self, batches):
        for batch in batches:
            with torch.no_grad():
                loss = self.model(batch).loss
            self.history.append(loss)

    def validation_step(self, batch, batch_idx):
        loss = self.model(batch).loss
        self.history.append(loss)

    def log_step(self, logs):
        output = {**logs, "step": 1}
        self.state.log_history.append(output)


class Schedule:
    """A pipeline schedule keeps outputs and losses for the backward it runs later."""

    def forward_one(self, stage, mb):
        output = stage(mb)
        self.fwd_cache[mb] = output
        loss = self.loss_fn(output, mb)
        self._internal_losses.append(loss)

    def backward_one(self, mb):
        loss = self._internal_losses[mb]
        loss.backward()


def micro_step(context, model, batch):
    loss = model(batch).loss
    for name in context.losses:
        context.losses[name].append(loss.detach())
    return loss


def record(losses, name, model, batch):
    aux_loss = model.aux(batch)
    losses.setdefault(name, []).append(aux_loss.item())


class AddOne(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.losses = []
        ctx.losses.append(x)  # LF001's business, not LF003's
        return x + 1
