# ruff: noqa
# Small LF003 cases beside the Fast-LLM stand-in: the shapes of loss logging that keep graphs
# (each flagged line carries a "# LF003" marker the tests read). A data file: never imported.
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

    def train_step(self, batch):
        logits = self.model(batch["x"])
        loss = self.criterion(logits, batch["y"])
        loss.backward()
        self.history.append(loss)  # LF003 self.history
        self.losses["ce"] = loss  # LF003 self.losses
        self.total_loss += loss  # LF003 self.total_loss
        self.total = self.total + loss.mean()  # LF003 self.total
        self.metrics["logits"].append(logits)  # LF003 self.metrics
        self.state.log_history.append({"loss": loss, "step": 1})  # LF003 self.state.log_history
        LOSS_HISTORY.append(loss.cpu())  # LF003 LOSS_HISTORY

    def step_with_alias(self, x, y):
        out = self.model(x)
        ce = F.cross_entropy(out, y)
        hist = self.history
        hist.append(ce * 2)  # LF003 self.history

    def step_collecting(self, batches):
        step_losses = []
        for batch in batches:
            loss = self.model(batch).loss
            loss.backward()
            step_losses.append(loss)  # LF003 self.per_step
        self.per_step = step_losses


def micro_step(context, model, batch):
    # the shape as the report spells it: a per-step context's dict of lists
    loss = model(batch).loss
    for name in context.losses:
        context.losses[name].append(loss)  # LF003 context.losses
    return loss


def record(losses, name, model, batch):
    aux_loss = model.aux(batch)
    losses.setdefault(name, []).append(aux_loss)  # LF003 losses
