"""Train a bag-of-words classifier on a text stream with a word-piece tokenizer that caches
each word's pieces (new words keep arriving for hundreds of steps)."""

import random
import sys
import zlib

import torch
from torch import nn

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
VOCAB = 4096


class WordPieceTokenizer:
    def __init__(self, vocab_size):
        self.vocab_size = vocab_size
        self.cache = {}

    def pieces(self, word):
        if word not in self.cache:
            chunks = [word[i : i + 3] for i in range(0, len(word), 3)]
            self.cache[word] = [zlib.crc32(c.encode()) % self.vocab_size for c in chunks]
        return self.cache[word]

    def __call__(self, text):
        return [piece for word in text.split() for piece in self.pieces(word)]


rng = random.Random(0)
letters = "abcdefghijklmnopqrstuvwxyz"
words = ["".join(rng.choices(letters, k=rng.randint(3, 12))) for _ in range(30000)]


def sentence():
    return " ".join(words[min(int(rng.paretovariate(0.6)), len(words)) - 1] for _ in range(24))


torch.manual_seed(0)
tokenizer = WordPieceTokenizer(VOCAB)
model = nn.EmbeddingBag(VOCAB, 32)
head = nn.Linear(32, 2)
opt = torch.optim.Adam([*model.parameters(), *head.parameters()], lr=1e-3)
for step in range(STEPS):
    texts = [sentence() for _ in range(8)]
    ids = [torch.tensor(tokenizer(t)) for t in texts]
    offsets = torch.tensor([0, *torch.tensor([len(i) for i in ids]).cumsum(0)[:-1].tolist()])
    labels = torch.tensor([len(t) % 2 for t in texts])
    loss = nn.functional.cross_entropy(head(model(torch.cat(ids), offsets)), labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 20 == 0:
        print(f"step {step} loss {loss.item():.3f} cached words {len(tokenizer.cache)}")
print("done", STEPS, "cached words", len(tokenizer.cache))
