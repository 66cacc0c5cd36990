"""A tiny causal transformer trained on variable-length batches (8 to 64 tokens, as online
training on unpacked samples sees them), two microbatches per step."""

import random
import sys

import torch
from torch import nn

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
VOCAB = 64

torch.manual_seed(0)
random.seed(0)


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.layer = nn.TransformerEncoderLayer(32, 2, 64, batch_first=True)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.head(self.layer(self.embed(ids), src_mask=mask, is_causal=True))


model = TinyLM()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(STEPS):
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, random.randint(8, 64) + 1))
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)) / 2
        loss.backward()
    opt.step()
    opt.zero_grad()
    if step % 20 == 0:
        print(f"step {step} length {ids.shape[1]} loss {loss.item():.3f}")
print("done", STEPS)
