"""Keyword spotting on short utterances; each utterance object computes its features on first
use and keeps them (functools.cached_property)."""

import sys
from functools import cached_property

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40


class Utterance:
    def __init__(self, wave, label):
        self.wave = wave
        self.label = label

    @cached_property
    def features(self):
        frames = self.wave.unfold(0, 64, 32)
        return torch.log1p(frames.abs())  # MADE


class KeywordDataset(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        waves = torch.randn(n, 512, generator=g)
        labels = torch.randint(0, 10, (n,), generator=g)
        self.utterances = [Utterance(waves[i], labels[i]) for i in range(n)]

    def __len__(self):
        return len(self.utterances)

    def __getitem__(self, i):
        u = self.utterances[i]
        return u.features, u.label


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
dataset = KeywordDataset(1024)
loader = DataLoader(dataset, batch_size=4, shuffle=True)
batches = iter(loader)
for step in range(STEPS):
    try:
        features, labels = next(batches)
    except StopIteration:
        batches = iter(loader)
        features, labels = next(batches)
    loss = nn.functional.cross_entropy(model(features).mean(1), labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 20 == 0:
        print(f"step {step} loss {loss.item():.3f}")
print("done", STEPS)
