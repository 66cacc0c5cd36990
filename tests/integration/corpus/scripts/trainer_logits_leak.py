"""Causal-LM fine-tuning with the Hugging Face Trainer (a tiny random Llama, CPU), gradient
accumulation over 4 microbatches; compute_loss keeps the logits for an epoch-end accuracy."""

import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

os.environ.setdefault("HF_HUB_OFFLINE", "1")
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
VOCAB, SEQ = 256, 8


class Rows(torch.utils.data.Dataset):
    def __init__(self, n):
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class AccuracyTrainer(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.epoch_logits = []
        self.epoch_labels = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs, num_items_in_batch=num_items_in_batch)  # MADE
        self.epoch_logits.append(outputs.logits)
        self.epoch_labels.append(inputs["labels"])
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    def epoch_accuracy(self):
        logits = torch.cat(self.epoch_logits)
        labels = torch.cat(self.epoch_labels)
        return (logits[:, :-1].argmax(-1) == labels[:, 1:]).float().mean().item()


config = LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
torch.manual_seed(0)
args = TrainingArguments(
    output_dir="trainer-out",
    max_steps=STEPS,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=4,
    learning_rate=1e-3,
    logging_steps=10,
    report_to=[],
    save_strategy="no",
    use_cpu=True,
    disable_tqdm=True,
    dataloader_num_workers=0,
    seed=0,
)
trainer = AccuracyTrainer(model=LlamaForCausalLM(config), args=args, train_dataset=Rows(8 * STEPS))
trainer.train()
print("done", trainer.state.global_step, "accuracy", round(trainer.epoch_accuracy(), 3))
