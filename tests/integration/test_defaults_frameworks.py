"""The framework callbacks at their DEFAULTS (no ``sample_every``, ``warmup`` or ``window``
given), on a real ``transformers.Trainer`` and a real Lightning ``Trainer``: a planted leak
is found within the run a user would make, and memory kept per microbatch is found in the
first optimizer steps.

The models, datasets and arguments are those of tests/integration/test_hf_trainer.py and
tests/integration/test_lightning.py (imported, not copied)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
L = pytest.importorskip("lightning.pytorch")

from leakfree import OffloadActivations  # noqa: E402
from leakfree.integrations import MemoryGrowthWarning  # noqa: E402
from leakfree.integrations.lightning import LeakfreeCallback as LightningCallback  # noqa: E402
from leakfree.integrations.transformers import LeakfreeCallback  # noqa: E402
from leakfree.testing import LeakError  # noqa: E402
from tests.integration.test_hf_trainer import (  # noqa: E402
    Rows,
    arguments,
    keeping_step_outputs,
    tiny_model,
)
from tests.integration.test_lightning import Tiny, fit  # noqa: E402

pytestmark = [
    # Lightning's advice about dataloader workers, and its use of a torch API deprecated
    # in 2.13, are not the point here.
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.* is deprecated"),
]


def _growth_messages(caught: Any) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, MemoryGrowthWarning)]


class KeepsLogits(transformers.Trainer):  # type: ignore[misc]
    """The logits kept on the trainer "for metrics", with their graph, every step."""

    kept: list[torch.Tensor]

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
        outputs = model(**inputs)
        self.kept.append(outputs.logits)  # should be outputs.logits.detach()
        return (outputs.loss, outputs) if return_outputs else outputs.loss


def test_hf_trainer_defaults_warn_of_logits_kept_with_their_graph(
    tmp_path: Path, recwarn: pytest.WarningsRecorder
) -> None:
    trainer = KeepsLogits(model=tiny_model(), args=arguments(tmp_path, 40), train_dataset=Rows(80))
    trainer.kept = []
    LeakfreeCallback().attach(trainer)  # the defaults
    trainer.train()
    messages = _growth_messages(recwarn)
    assert any("kept[" in m for m in messages), messages


class KeepsOutputs(transformers.Trainer):  # type: ignore[misc]
    """Every microbatch's ``outputs`` (logits and loss, with their graphs) kept until the
    optimizer step, for the step's metrics: never grows from step to step."""

    step_outputs: list[Any]

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
        outputs = model(**inputs)
        self.step_outputs.append(outputs)  # the Trainer backpropagates outputs.loss
        return (outputs.loss, outputs) if return_outputs else outputs.loss


def test_hf_trainer_defaults_fail_on_outputs_kept_per_microbatch(tmp_path: Path) -> None:
    trainer = keeping_step_outputs(KeepsOutputs, tmp_path, 6)
    LeakfreeCallback(fail=True).attach(trainer)  # the defaults otherwise
    with pytest.raises(LeakError) as e:
        trainer.train()
    assert "step_outputs" in str(e.value)
    assert trainer.state.global_step <= 2  # within the first optimizer steps


class KeepsLoss(Tiny):
    """The loss kept with its graph on the module, every training step."""

    def __init__(self) -> None:
        super().__init__(leaky=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.kept.append(loss)  # should be loss.detach()
        return loss


def test_lightning_defaults_warn_of_a_loss_kept_with_its_graph(
    tmp_path: Path, recwarn: pytest.WarningsRecorder
) -> None:
    callback = LightningCallback()  # the defaults
    fit(tmp_path, callback, leaky=False, steps=24, module=KeepsLoss())
    messages = _growth_messages(recwarn)
    assert any("kept[" in m for m in messages), messages


class OffloadsAndKeepsLogits(KeepsLogits):
    """The same leak in a step that checkpoints (``gradient_checkpointing=True``) and
    offloads what it saves (``leakfree.OffloadActivations``), as memory-bound jobs do."""

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
        with OffloadActivations(force_host_copy=True):
            return super().compute_loss(model, inputs, return_outputs, **kw)


def test_hf_trainer_defaults_find_it_with_checkpointing_and_offloading(
    tmp_path: Path, recwarn: pytest.WarningsRecorder
) -> None:
    args = arguments(tmp_path, 20, gradient_checkpointing=True)
    trainer = OffloadsAndKeepsLogits(model=tiny_model(), args=args, train_dataset=Rows(40))
    trainer.kept = []
    callback = LeakfreeCallback().attach(trainer)  # the defaults
    trainer.train()
    messages = _growth_messages(recwarn)
    assert any("kept[" in m for m in messages), messages
    assert callback.watch.verdict == "leak"
