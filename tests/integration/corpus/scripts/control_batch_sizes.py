"""Train an MLP on batches whose size changes every step (4 to 64 rows, as dynamic batching by
size makes them), two microbatches per step."""

import random
import sys

import torch
from torch import nn

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40

torch.manual_seed(0)
random.seed(0)
model = nn.Sequential(
    nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8)
)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
losses = []
for step in range(STEPS):
    for _ in range(2):
        rows = random.randint(4, 64)
        x, y = torch.randn(rows, 64), torch.randint(0, 8, (rows,))
        loss = nn.functional.cross_entropy(model(x), y) / 2
        loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
    if step % 20 == 0:
        print(f"step {step} rows {rows} loss {loss.item():.3f}")
print("done", STEPS)
