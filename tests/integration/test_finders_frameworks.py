"""No false alarm on clean runs of the distributed wrappers people train with: DDP and
FSDP2 (``fully_shard``) over gloo, 2 ranks, AdamW, gradient accumulation, a LossLog;
``torch.distributed.pipelining`` (repaired by ``patch_all``) lives in test_pipelining.py.
Each rank runs the exact detector (every step tracked) and reports its findings; the same
loop keeping its losses is reported on its rank in tests/integration/test_run.py."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests._dist import run_workers
from tests.integration._models import tiny_llama_config

STEPS, MICRO = 14, 3


def _worker(rank: int, world: int, wrapper: str, leak: bool) -> dict[str, Any]:
    from leakfree import LossLog
    from leakfree.diagnostics import MemoryTracker

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    if wrapper == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    log = LossLog(["lm"])
    kept: list[torch.Tensor] = []
    tracker = MemoryTracker(devices=["cpu"], sample_every=1, warn=False)
    g = torch.Generator().manual_seed(rank)
    with tracker:
        for _ in range(STEPS):
            for i in range(MICRO):
                last = i == MICRO - 1
                quiet = (
                    model.no_sync() if wrapper == "ddp" and not last else contextlib.nullcontext()
                )
                if wrapper == "fsdp2":
                    model.set_requires_gradient_sync(last)
                with quiet:
                    loss = model(torch.randn(8, 32, generator=g)).square().mean() / MICRO
                    loss.backward()
                log["lm"].append(loss)
                if leak:
                    kept.append(loss)  # the same loop, logging the loss with its graph
            opt.step()
            opt.zero_grad()
            log.reduce()
            tracker.step()
    return {
        "findings": [f.message for f in tracker.findings],
        "growth": tracker.growth("cpu", skip=2).bytes_per_step,
    }


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_clean_distributed_training_is_quiet(wrapper: str, tmp_path: Path) -> None:
    results = run_workers(_worker, 2, tmp_path, wrapper, False, timeout=180)
    for rank, r in enumerate(results):
        assert r["findings"] == [], (rank, r["findings"])
        assert r["growth"] == 0, (rank, r["growth"])


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated")
def test_trl_sft_trainer_with_offloading_and_accumulation_is_quiet(tmp_path: Path) -> None:
    """TRL's ``SFTTrainer`` on a tiny random Llama, activation offloading on (leakfree's,
    through ``patch_all``), gradient accumulation, AdamW: the callback, watching every step
    and every backward, finds nothing."""
    pytest.importorskip("trl")
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    import leakfree
    from leakfree.integrations import MemoryGrowthWarning
    from leakfree.integrations.transformers import LeakfreeCallback

    leakfree.patch_all()
    try:
        from trl import SFTConfig, SFTTrainer

        torch.manual_seed(0)
        vocab = 64
        config = tiny_llama_config(vocab)
        words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=words, unk_token="t0", pad_token="t1", eos_token="t2"
        )
        rows = torch.randint(3, vocab, (96, 24), generator=torch.Generator().manual_seed(0))
        args = SFTConfig(
            output_dir=str(tmp_path),
            max_steps=9,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            learning_rate=1e-3,
            logging_steps=4,
            report_to="none",
            save_strategy="no",
            activation_offloading=True,
            bf16=False,
            use_cpu=True,
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=0,
        )
        trainer = SFTTrainer(
            model=LlamaForCausalLM(config),
            args=args,
            train_dataset=Dataset.from_dict({"input_ids": rows.tolist()}),
            processing_class=tokenizer,
        )
        callback = LeakfreeCallback(warmup=2, window=6, sample_every=1).attach(trainer)
        with warnings.catch_warnings():
            warnings.simplefilter("error", MemoryGrowthWarning)
            trainer.train()
    finally:
        leakfree.unpatch_all()
    assert callback.watch.steps == 9 and callback.watch.findings == []
    assert callback.watch.growth is not None
