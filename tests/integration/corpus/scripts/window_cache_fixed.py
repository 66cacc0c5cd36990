"""Forecast the next value of a multivariate series from normalised windows; each window
computes its normalised features once and caches them."""

import functools
import sys

import torch
from torch import nn

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
LENGTH, CHANNELS = 32, 8


class Window:
    def __init__(self, series, start):
        self.series = series
        self.start = start

    @functools.cached_property
    def features(self):
        x = self.series[self.start : self.start + LENGTH]
        return (x - x.mean(0)) / (x.std(0) + 1e-5)

    @property
    def target(self):
        return self.series[self.start + LENGTH, 0]


torch.manual_seed(0)
series = torch.randn(4096, CHANNELS).cumsum(0)
model = nn.Sequential(nn.Flatten(), nn.Linear(LENGTH * CHANNELS, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(STEPS):
    starts = torch.randint(0, len(series) - LENGTH - 1, (8,)).tolist()
    windows = [Window(series, s) for s in starts]
    x = torch.stack([w.features for w in windows])
    y = torch.stack([w.target for w in windows])
    loss = nn.functional.mse_loss(model(x).squeeze(-1), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 20 == 0:
        print(f"step {step} loss {loss.item():.3f}")
print("done", STEPS)
