"""Fine-tune a small speech-to-text head on log-magnitude frames; the features are computed
when an item is read."""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
VOCAB = 100


class SpeechTextDataset(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.waves = torch.randn(n, 400, generator=g)
        self.texts = torch.randint(0, VOCAB, (n, 12), generator=g)

    def __len__(self):
        return len(self.waves)

    def __getitem__(self, i):
        frames = self.waves[i].unfold(0, 80, 40)
        features = torch.log1p(frames.abs())
        return {"input_features": features, "labels": self.texts[i]}


torch.manual_seed(0)
encoder = nn.Sequential(nn.Linear(80, 64), nn.GELU())
head = nn.Linear(64, VOCAB)
opt = torch.optim.AdamW([*encoder.parameters(), *head.parameters()], lr=1e-3)
loader = DataLoader(SpeechTextDataset(1024), batch_size=4, shuffle=True)
batches = iter(loader)
for step in range(STEPS):
    try:
        batch = next(batches)
    except StopIteration:
        batches = iter(loader)
        batch = next(batches)
    hidden = encoder(batch["input_features"]).mean(1)
    loss = nn.functional.cross_entropy(head(hidden), batch["labels"][:, 0])
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 20 == 0:
        print(f"step {step} loss {loss.item():.3f}")
print("done", STEPS)
