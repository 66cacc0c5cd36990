"""leakfree.integrations.transformers with the real ``transformers.Trainer``: a tiny random
GPT-2 from a config, an in-memory dataset, CPU, no downloads, no reporting."""

from __future__ import annotations

import gc
import os
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import leakfree

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from leakfree.integrations import MemoryGrowthWarning  # noqa: E402
from leakfree.integrations.transformers import LeakfreeCallback, LossLogMixin  # noqa: E402
from leakfree.testing import LeakError  # noqa: E402

VOCAB, SEQ = 64, 8


def tiny_model() -> Any:
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_inner=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


class Rows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def arguments(tmp_path: Path, steps: int, **kw: Any) -> Any:
    options: dict[str, Any] = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=steps,
        logging_steps=2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        learning_rate=1e-3,
        seed=0,
    )
    options.update(kw)
    return transformers.TrainingArguments(**options)


class KeepsLogits(transformers.Trainer):  # type: ignore[misc]
    """The leak: the logits kept "for metrics" with their graph, on the model."""

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
        out = model(**inputs)
        model.kept.append(out.logits)  # should be out.logits.detach()
        return (out.loss, out) if return_outputs else out.loss


def train(trainer_cls: type, tmp_path: Path, callback: LeakfreeCallback, steps: int) -> Any:
    model = tiny_model()
    model.kept = []
    trainer = trainer_cls(
        model=model, args=arguments(tmp_path, steps), train_dataset=Rows(2 * steps)
    )
    callback.attach(trainer)
    trainer.train()
    return trainer


def test_leaky_step_is_reported_with_growth_and_holder(tmp_path: Path) -> None:
    callback = LeakfreeCallback(warmup=2, window=6, sample_every=1)
    with pytest.warns(MemoryGrowthWarning) as caught:
        trainer = train(KeepsLogits, tmp_path, callback, steps=8)
    message = str(caught[0].message)
    per_step = 2 * SEQ * VOCAB * 4  # one batch's float32 logits
    assert "grows by" in message and "over optimizer steps 3-8 (6 steps" in message
    assert "model.kept[*]" in message  # the holder
    assert "created at transformers/models/gpt2/modeling_gpt2.py:" in message  # the logits
    assert "(from tests/integration/test_hf_trainer.py:" in message  # in compute_loss
    growth = callback.watch.growth
    assert growth is not None and growth.bytes_per_step > 0.9 * per_step
    assert any(r.where.startswith("model.kept[") for r in callback.watch.retained or ())
    # The numbers went through the Trainer's own logs (its history, and every callback after).
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 4
    assert all(h["leakfree/live_bytes"] > 0 for h in logged)
    assert logged[-1]["leakfree/growth_bytes_per_step"] == growth.bytes_per_step
    assert not callback.watch.active  # on_train_end stopped the storage tracker


def test_fail_raises_out_of_train(tmp_path: Path) -> None:
    callback = LeakfreeCallback(warmup=2, window=4, fail=True, sample_every=1)
    with pytest.raises(LeakError, match=r"(?s)grows by .*model\.kept\[\*\]"):
        train(KeepsLogits, tmp_path, callback, steps=8)
    assert callback.watch.steps == 8  # suspected at step 6, what grew named at step 8
    assert not callback.watch.active  # and stopped tracking before raising


def test_clean_training_is_not_reported(tmp_path: Path) -> None:
    callback = LeakfreeCallback(warmup=2, window=6, sample_every=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryGrowthWarning)
        trainer = train(transformers.Trainer, tmp_path, callback, steps=8)
    growth = callback.watch.growth
    assert growth is not None and not growth.exceeds()
    assert trainer.state.log_history[-2]["leakfree/growth_bytes_per_step"] == growth.bytes_per_step


class KeepsEntropy(transformers.Trainer):  # type: ignore[misc]
    """verl's shape in a Trainer: per-microbatch entropy kept with its graph "for
    metrics" until the optimizer step, when it is read and dropped. It never grows from
    step to step; a step with enough microbatches runs out of memory."""

    step_outputs: list[dict[str, torch.Tensor]]

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
        out = model(**inputs)
        p = out.logits.softmax(-1)
        entropy = -(p * p.log()).sum(-1)  # with grad; not in the loss
        self.step_outputs.append({"entropy": entropy})
        return (out.loss, out) if return_outputs else out.loss


class ClearsStepOutputs(transformers.TrainerCallback):  # type: ignore[misc]
    """Reads a trainer's ``step_outputs`` at the step's end, and drops them."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.trainer.step_outputs.clear()  # the step's metrics, read and dropped


def keeping_step_outputs(trainer_cls: type, tmp_path: Path, steps: int) -> Any:
    """A ``trainer_cls`` that fills ``step_outputs`` over 4 microbatches a step, read and
    dropped at each step's end (:class:`ClearsStepOutputs`)."""
    trainer = trainer_cls(
        model=tiny_model(),
        args=arguments(tmp_path, steps, gradient_accumulation_steps=4),
        train_dataset=Rows(8 * steps),
    )
    trainer.step_outputs = []
    trainer.add_callback(ClearsStepOutputs(trainer))
    return trainer


def test_retention_per_microbatch_is_reported_in_the_first_optimizer_step(
    tmp_path: Path,
) -> None:
    """With the callback's defaults (a 3-step warm-up, a 10-step window, sampling)."""
    trainer = keeping_step_outputs(KeepsEntropy, tmp_path, 2)
    callback = LeakfreeCallback(fail=True).attach(trainer)
    with pytest.raises(LeakError, match="kept per backward pass") as e:
        trainer.train()
    message = str(e.value)
    assert "of step 1" in message and callback.watch.steps == 0  # before its first step
    assert "trainer.step_outputs[*]['entropy']  2 graphs" in message
    line = next(
        i
        for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
        if "entropy = -(p * p.log())" in text
    )
    assert f"created at tests/integration/test_hf_trainer.py:{line} in KeepsEntropy" in message


def test_clean_training_with_the_defaults_and_accumulation_is_quiet(tmp_path: Path) -> None:
    """AdamW (the Trainer's default), gradient accumulation, the callback's defaults."""
    trainer = AuxTrainer(
        model=tiny_model(),
        args=arguments(tmp_path, 24, gradient_accumulation_steps=3),
        train_dataset=Rows(144),
        loss_log=["z_loss"],
    )
    trainer.by_hand, trainer.weak = [], []
    callback = LeakfreeCallback(sample_every=2).attach(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryGrowthWarning)
        trainer.train()
    assert callback.watch.findings == [] and callback.watch.growth is not None


@pytest.mark.filterwarnings("ignore::leakfree.NotJudgedWarning")  # 2 steps: too short to judge
def test_attach_puts_the_callback_before_reporting_integrations(tmp_path: Path) -> None:
    trainer = transformers.Trainer(
        model=tiny_model(), args=arguments(tmp_path, 2), train_dataset=Rows(4)
    )

    class Reporter(transformers.TrainerCallback):  # type: ignore[misc]
        """Stands where report_to's integrations stand: before the callbacks you add."""

        seen: list[dict[str, Any]] = []

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            self.seen.append(dict(logs))

    trainer.callback_handler.callbacks.insert(1, Reporter())
    LeakfreeCallback(warmup=0, window=4).attach(trainer)
    names = [type(cb).__name__ for cb in trainer.callback_handler.callbacks]
    assert names[:3] == ["DefaultFlowCallback", "LeakfreeCallback", "Reporter"]
    trainer.train()
    assert "leakfree/live_bytes" in Reporter.seen[0]


def test_log_false_keeps_the_numbers_out_of_the_logs(tmp_path: Path) -> None:
    """Both callbacks take one signature (the shared watcher's), ``log`` included: the HF
    callback had no ``log`` and always wrote its numbers into the Trainer's logs."""
    from leakfree.integrations._growth import WatchingCallback

    assert LeakfreeCallback.__init__ is WatchingCallback.__init__
    trainer = transformers.Trainer(
        model=tiny_model(), args=arguments(tmp_path, 2), train_dataset=Rows(4)
    )
    callback = LeakfreeCallback(warmup=0, window=4, log=False).attach(trainer)
    with pytest.warns(leakfree.NotJudgedWarning, match="2 of the 4 optimizer steps"):
        trainer.train()  # a run too short to judge says so at its end
    assert callback.watch.steps == 2 and callback.watch.verdict == "not judged"
    assert not any(k.startswith("leakfree/") for h in trainer.state.log_history for k in h)
    with pytest.raises(TypeError, match=r"LeakfreeCallback\(log='yes'\): expected True"):
        LeakfreeCallback(log="yes")  # type: ignore[arg-type]


class AuxTrainer(LossLogMixin, transformers.Trainer):  # type: ignore[misc]
    """Records an auxiliary loss (the z-loss of the logits) next to the LM loss."""

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
        out = model(**inputs)
        z = 1e-4 * torch.logsumexp(out.logits, dim=-1).square().mean()
        self.record_loss("z_loss", z)
        self.by_hand.append(z.item())
        self.weak.append(weakref.ref(z))
        loss = out.loss + z
        return (loss, out) if return_outputs else loss


def test_losslog_mixin_logs_the_mean_and_keeps_no_graph(tmp_path: Path) -> None:
    trainer = AuxTrainer(
        model=tiny_model(),
        args=arguments(tmp_path, 6, gradient_accumulation_steps=2),
        train_dataset=Rows(24),
        loss_log=["z_loss"],
    )
    trainer.by_hand, trainer.weak = [], []
    callback = LeakfreeCallback(warmup=0, window=4).attach(trainer)
    trainer.train()
    assert callback.watch.steps == 6  # optimizer steps, not the 12 microbatches
    logged = [h["z_loss"] for h in trainer.state.log_history if "loss" in h]
    # logging_steps=2 optimizer steps of 2 microbatches each: 4 values per log
    by_hand = [sum(trainer.by_hand[i : i + 4]) / 4 for i in range(0, 12, 4)]
    assert logged == pytest.approx(by_hand, rel=1e-6)
    gc.collect()
    assert all(ref() is None for ref in trainer.weak)  # no recorded loss kept alive
    assert all(len(v) == 0 for v in trainer.loss_log.values())  # cleared at each log


def test_losslog_mixin_records_nothing_during_evaluation(tmp_path: Path) -> None:
    trainer = AuxTrainer(
        model=tiny_model(),
        args=arguments(tmp_path, 2, per_device_eval_batch_size=2),
        train_dataset=Rows(4),
        eval_dataset=Rows(4),
        loss_log=["z_loss"],
    )
    trainer.by_hand, trainer.weak = [], []
    trainer.evaluate()
    assert len(trainer.by_hand) == 2 and len(trainer.loss_log["z_loss"]) == 0


def test_losslog_mixin_refuses_a_trainer_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"AuxTrainer\(loss_log=\.\.\.\): 'loss' is a key"):
        AuxTrainer(
            model=tiny_model(),
            args=arguments(tmp_path, 2),
            train_dataset=Rows(4),
            loss_log=["loss"],
        )


def test_bad_options_name_the_argument(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"LeakfreeCallback\(window=3\): expected an int >= 4"):
        LeakfreeCallback(window=3)
    expected = r"LeakfreeCallback\.attach\(trainer=GPT2LMHeadModel\): expected a transformers\."
    with pytest.raises(TypeError, match=expected):
        LeakfreeCallback().attach(tiny_model())
    with pytest.raises(TypeError, match=r"AuxTrainer\(loss_log_groups='dp'\)"):
        AuxTrainer(
            model=tiny_model(),
            args=arguments(tmp_path, 2),
            train_dataset=Rows(4),
            loss_log=["z_loss"],
            loss_log_groups="dp",
        )
