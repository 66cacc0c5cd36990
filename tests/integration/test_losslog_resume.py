"""A ``LossLog`` resumed from a real framework checkpoint mid-accumulation reduces to the
same floats as an uninterrupted run: Lightning's ``on_save_checkpoint`` /
``on_load_checkpoint``, and the HF ``Trainer`` through a callback (docs/losslog.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import leakfree


def test_a_pickled_log_loads_with_torch_load_defaults_in_a_fresh_interpreter(
    tmp_path: Path,
) -> None:
    log = leakfree.LossLog(["lm"], running=True)
    log["lm"].extend([torch.tensor(1.0), torch.tensor(3.0)])
    listed = leakfree.LossLog(["lm"])
    listed["lm"].append(torch.tensor(2.0))
    torch.save({"running": log, "list": listed}, tmp_path / "ckpt.pt")
    code = (
        "import torch, leakfree\n"
        f"ck = torch.load({str(tmp_path / 'ckpt.pt')!r})\n"
        "assert isinstance(ck['running'], leakfree.LossLog) and ck['running'].running\n"
        "print(ck['running'].reduce(), ck['list'].reduce())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "{'lm': 2.0} {'lm': 2.0}"


L = pytest.importorskip("lightning.pytorch")

WIDTH, BATCH, BATCHES = 8, 4, 3


class Logged(L.LightningModule):  # type: ignore[misc]
    """Logs each step's loss; reduces every two epochs (accumulation spans a checkpoint)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(WIDTH, 1)
        self.losses = leakfree.LossLog({"lm": "mean", "worst": "max"})
        self.reduced: list[dict[str, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = self.net(x).square().mean()
        self.losses["lm"].append(loss)
        self.losses["worst"].append(loss)
        return loss

    def on_train_epoch_end(self) -> None:
        if (self.current_epoch + 1) % 2 == 0:
            self.reduced.append(self.losses.reduce())

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["losslog"] = self.losses.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.losses.load_state_dict(checkpoint["losslog"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path: Path, epochs: int, module: Logged, ckpt: Path | None = None) -> Any:
    data = torch.utils.data.TensorDataset(
        torch.randn(BATCH * BATCHES, WIDTH, generator=torch.Generator().manual_seed(1))
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH), ckpt_path=ckpt)
    return trainer


pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.* is deprecated"),
]


def test_lightning_resume_mid_accumulation(tmp_path: Path) -> None:
    whole = Logged()
    _fit(tmp_path / "whole", 2, whole)
    first = Logged()
    trainer = _fit(tmp_path / "first", 1, first)
    ckpt = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(ckpt)  # one epoch logged, not reduced yet
    assert first.reduced == []
    resumed = Logged()
    _fit(tmp_path / "resumed", 2, resumed, ckpt)
    assert resumed.reduced == whole.reduced and len(whole.reduced) == 1


transformers = pytest.importorskip("transformers")


class LossLogCheckpoint(transformers.TrainerCallback):  # type: ignore[misc]
    """docs/losslog.md's callback: the log's state beside each checkpoint, read back when
    training resumes from one."""

    def __init__(self, log: leakfree.LossLog) -> None:
        self.log = log

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        torch.save(self.log.state_dict(), os.path.join(folder, "losslog.pt"))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", "losslog.pt")
        if state.global_step and os.path.exists(path):
            self.log.load_state_dict(torch.load(path))  # weights_only: plain data


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, labels: Any = None) -> dict[str, torch.Tensor]:
        return {"loss": self.net(x).square().mean()}


class LoggingTrainer(transformers.Trainer):  # type: ignore[misc]
    def __init__(self, *a: Any, losses: leakfree.LossLog, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.losses = losses

    def compute_loss(self, model: Any, inputs: Any, **kw: Any) -> Any:
        loss = model(**inputs)["loss"]
        self.losses["lm"].append(loss)
        return loss


class StopAt(transformers.TrainerCallback):  # type: ignore[misc]
    """Ends training after ``step`` (its checkpoint is saved): an interrupted run."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


def _train(out: Path, log: leakfree.LossLog, resume: bool = False, stop: int | None = None) -> None:
    data = [
        {"x": x} for x in torch.randn(BATCH * 4, WIDTH, generator=torch.Generator().manual_seed(1))
    ]
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=4, per_device_train_batch_size=BATCH,
        lr_scheduler_type="constant",
        save_steps=2, save_strategy="steps", report_to=[], use_cpu=True, logging_steps=100,
        disable_tqdm=True, dataloader_num_workers=0, seed=0, data_seed=0,
    )  # fmt: skip
    trainer = LoggingTrainer(
        model=Tiny(), args=args, train_dataset=data, losses=log,
        callbacks=[LossLogCheckpoint(log), *([StopAt(stop)] if stop else [])],
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=resume or None)


def test_hf_trainer_resume_mid_accumulation(tmp_path: Path) -> None:
    whole = leakfree.LossLog(["lm"])
    _train(tmp_path / "whole", whole)
    first = leakfree.LossLog(["lm"])
    _train(tmp_path / "run", first, stop=2)  # checkpoint-2 holds the log's first two values
    assert len(first["lm"]) == 2
    resumed = leakfree.LossLog(["lm"])
    _train(tmp_path / "run", resumed, resume=True)
    assert len(resumed["lm"]) == 4
    assert resumed.reduce() == whole.reduce()
