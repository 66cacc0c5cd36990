"""Fit an energy model over many small systems; each step loads one system's coordinates and
energies through a bounded LRU cache (24 systems), as data loaders cache set files."""

import sys
from functools import lru_cache

import torch
from torch import nn

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
SYSTEMS, ATOMS = 400, 64


@lru_cache(maxsize=24)
def load_system(i):
    g = torch.Generator().manual_seed(i)
    coords = torch.randn(ATOMS, 3, generator=g)
    energies = coords.square().sum(-1, keepdim=True) + 0.1 * torch.randn(ATOMS, 1, generator=g)
    return coords, energies


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3, 64), nn.SiLU(), nn.Linear(64, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(STEPS):
    coords, energies = load_system(step % SYSTEMS)
    loss = nn.functional.mse_loss(model(coords), energies)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 20 == 0:
        print(f"step {step} loss {loss.item():.3f} {load_system.cache_info()}")
print("done", STEPS, load_system.cache_info())
