"""Gradual unfreezing: a 6-block network starts with its blocks frozen and unfreezes one
block (top first) every 4 steps; AdamW makes each block's state at its first update."""

import sys

import torch
from torch import nn

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
UNFREEZE_EVERY = 4

torch.manual_seed(0)
blocks = nn.ModuleList([nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(6)])
head = nn.Linear(64, 10)
for p in blocks.parameters():
    p.requires_grad_(False)
opt = torch.optim.AdamW([*blocks.parameters(), *head.parameters()], lr=1e-3)
for step in range(STEPS):
    if step % UNFREEZE_EVERY == 0 and step // UNFREEZE_EVERY < len(blocks):
        blocks[len(blocks) - 1 - step // UNFREEZE_EVERY].requires_grad_(True)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    for block in blocks:
        x = block(x)
    loss = nn.functional.cross_entropy(head(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 20 == 0:
        print(f"step {step} loss {loss.item():.3f} states {len(opt.state)}")
print("done", STEPS, "states", len(opt.state))
