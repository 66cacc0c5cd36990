"""leakfree.integrations.lightning with a real Lightning ``Trainer``: a tiny module, CPU,
a CSV logger under tmp_path, no checkpoints, no progress bar."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")

from leakfree.integrations import MemoryGrowthWarning, NotJudgedWarning  # noqa: E402
from leakfree.integrations.lightning import LeakfreeCallback  # noqa: E402
from leakfree.testing import LeakError  # noqa: E402

BATCH, WIDTH = 4, 32


class Tiny(L.LightningModule):  # type: ignore[misc]
    def __init__(self, leaky: bool) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1)
        )
        self.leaky = leaky
        self.kept: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        hidden = self.net[1](self.net[0](x))
        loss = self.net[2](hidden).square().mean()
        if self.leaky:
            self.kept.append(hidden)  # should be hidden.detach()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def trainer_for(
    tmp_path: Path, callback: LeakfreeCallback, steps: int, *, package: Any = None, **kw: Any
) -> Any:
    """A quiet CPU trainer of ``package`` (Lightning by default) for ``steps`` optimizer
    steps with ``callback``; ``kw``: more trainer options (no logger unless given)."""
    options: dict[str, Any] = {"logger": False, **kw}
    return (L if package is None else package).Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **options,
    )


def fit(
    tmp_path: Path,
    callback: LeakfreeCallback,
    leaky: bool,
    steps: int,
    module: Any = None,
    **kw: Any,
) -> Any:
    data = torch.utils.data.TensorDataset(torch.randn(BATCH * steps * 2, WIDTH))
    logger = L.loggers.CSVLogger(tmp_path, name="run")
    trainer = trainer_for(
        tmp_path, callback, steps, devices=1, logger=logger, log_every_n_steps=1, **kw
    )
    module = Tiny(leaky) if module is None else module
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH))
    return trainer


def logged(trainer: Any) -> list[dict[str, str]]:
    trainer.logger.save()
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


pytestmark = [
    # Lightning's advice about dataloader workers, and its use of a torch API deprecated
    # in 2.13, are not the point here.
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.* is deprecated"),
]


def test_leaky_step_is_reported_with_growth_and_holder(tmp_path: Path) -> None:
    callback = LeakfreeCallback(warmup=2, window=6, sample_every=1)
    with pytest.warns(MemoryGrowthWarning) as caught:
        trainer = fit(tmp_path, callback, leaky=True, steps=8)
    message = str(next(w for w in caught if w.category is MemoryGrowthWarning).message)
    assert "grows by" in message and "over optimizer steps 3-8 (6 steps" in message
    assert "pl_module.kept[*]" in message  # the holder
    assert "created at tests/integration/test_lightning.py:" in message
    growth = callback.watch.growth
    assert growth is not None and growth.bytes_per_step > 0.9 * BATCH * WIDTH * 4
    # The numbers went through pl_module.log to the logger (one row per step).
    rows = [r for r in logged(trainer) if r.get("leakfree/live_bytes")]
    assert len(rows) == 8
    logged_growth = float(rows[-1]["leakfree/growth_bytes_per_step"])  # a float32 metric
    assert logged_growth == pytest.approx(growth.bytes_per_step, rel=1e-6)
    assert trainer.logged_metrics["leakfree/growth_bytes_per_step"] == pytest.approx(
        growth.bytes_per_step, rel=1e-6
    )
    assert not callback.watch.active


def test_fail_raises_out_of_fit(tmp_path: Path) -> None:
    callback = LeakfreeCallback(warmup=2, window=4, fail=True, sample_every=1)
    with pytest.raises(LeakError, match=r"(?s)grows by .*pl_module\.kept\[\*\]"):
        fit(tmp_path, callback, leaky=True, steps=8)
    # suspected at step 6 (four steps after the warm-up), what grew named at step 8
    assert callback.watch.steps == 8 and not callback.watch.active


def test_clean_training_is_not_reported(tmp_path: Path) -> None:
    callback = LeakfreeCallback(warmup=2, window=6, sample_every=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryGrowthWarning)
        fit(tmp_path, callback, leaky=False, steps=8)
    growth = callback.watch.growth
    assert growth is not None and not growth.exceeds()


class KeepsPerBatch(Tiny):
    """Metrics kept with their graph for each batch of an accumulated step, dropped at
    the optimizer step: the memory builds up within the step only."""

    def __init__(self) -> None:
        super().__init__(leaky=False)
        self.step_outputs: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        hidden = self.net[1](self.net[0](x))
        self.step_outputs.append(hidden.sigmoid())  # with grad, not in the loss
        return self.net[2](hidden).square().mean()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.step_outputs.clear()


def test_retention_per_batch_is_reported_in_the_first_optimizer_step(tmp_path: Path) -> None:
    callback = LeakfreeCallback(fail=True)  # the defaults
    with pytest.raises(LeakError, match=r"(?s)of step 1.*step_outputs\[\*\]  \d graphs"):
        fit(tmp_path, callback, False, 4, KeepsPerBatch(), accumulate_grad_batches=4)
    assert callback.watch.steps == 0 and not callback.watch.active


def test_clean_training_with_the_defaults_and_accumulation_is_quiet(tmp_path: Path) -> None:
    callback = LeakfreeCallback(sample_every=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryGrowthWarning)
        fit(tmp_path, callback, leaky=False, steps=30, accumulate_grad_batches=2)
    assert callback.watch.findings == [] and callback.watch.growth is not None


def test_steps_are_optimizer_steps_under_gradient_accumulation(tmp_path: Path) -> None:
    callback = LeakfreeCallback(warmup=0, window=4)
    trainer = fit(tmp_path, callback, leaky=False, steps=4, accumulate_grad_batches=2)
    assert trainer.global_step == 4 and callback.watch.steps == 4


def test_standalone_pytorch_lightning_trainer_runs_it(tmp_path: Path) -> None:
    """The standalone package calls callbacks by hook name, as ``lightning`` does."""
    PL = pytest.importorskip("pytorch_lightning")

    class Module(PL.LightningModule):  # type: ignore[misc]
        training_step = Tiny.training_step
        configure_optimizers = Tiny.configure_optimizers

        def __init__(self) -> None:
            super().__init__()
            self.net = Tiny(leaky=True).net
            self.leaky, self.kept = True, []

    callback = LeakfreeCallback(warmup=2, window=6, sample_every=1)
    data = torch.utils.data.TensorDataset(torch.randn(BATCH * 16, WIDTH))
    trainer = trainer_for(tmp_path, callback, 8, package=PL)
    with pytest.warns(MemoryGrowthWarning, match=r"pl_module\.kept\["):
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=BATCH))
    assert callback.watch.steps == 8 and not callback.watch.active
    assert trainer.logged_metrics["leakfree/growth_bytes_per_step"] > 0


def test_bad_options_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"LeakfreeCallback\(warmup=-1\): expected an int >= 0"):
        LeakfreeCallback(warmup=-1)
    with pytest.raises(TypeError, match=r"LeakfreeCallback\(log='yes'\): expected True or False"):
        LeakfreeCallback(log="yes")  # type: ignore[arg-type]


def test_a_raising_step_leaves_no_tracker_behind(tmp_path: Path) -> None:
    """on_exception stops the CPU storage tracker: no dispatch mode outlives the fit."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    class Raises(Tiny):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx == 2:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    callback = LeakfreeCallback(warmup=0, window=4)
    data = torch.utils.data.TensorDataset(torch.randn(BATCH * 8, WIDTH))
    trainer = trainer_for(tmp_path, callback, 8)
    with warnings.catch_warnings():  # the error says enough: no "not judged" beside it
        warnings.simplefilter("error", NotJudgedWarning)
        with pytest.raises(RuntimeError, match="boom"):
            trainer.fit(Raises(leaky=False), torch.utils.data.DataLoader(data, batch_size=BATCH))
    assert callback.watch.steps == 2 and callback.watch.verdict == "not judged"
    assert not callback.watch.active and _get_current_dispatch_mode() is None
