"""DQN on a toy continuous-observation task with 4 parallel environments and a replay buffer
of the last 64 transitions (full after 16 steps)."""

import random
import sys
from collections import deque

import torch
from torch import nn

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
ENVS, OBS, ACTIONS, GAMMA = 4, 48, 4, 0.99

torch.manual_seed(0)
random.seed(0)
q = nn.Sequential(nn.Linear(OBS, 64), nn.ReLU(), nn.Linear(64, ACTIONS))
target = nn.Sequential(nn.Linear(OBS, 64), nn.ReLU(), nn.Linear(64, ACTIONS))
target.load_state_dict(q.state_dict())
opt = torch.optim.Adam(q.parameters(), lr=1e-3)
buffer = deque(maxlen=64)
obs = torch.randn(ENVS, OBS)
for step in range(STEPS):
    with torch.no_grad():
        action = q(obs).argmax(-1)
    next_obs = torch.tanh(obs + 0.1 * torch.randn(ENVS, OBS))
    reward = (action == 0).float() - 0.1 * next_obs.abs().mean(-1)
    for i in range(ENVS):
        buffer.append((obs[i].clone(), action[i], reward[i], next_obs[i].clone()))
    obs = next_obs

    batch = random.sample(list(buffer), min(len(buffer), 32))
    s, a, r, s2 = (torch.stack(x) for x in zip(*batch))
    with torch.no_grad():
        goal = r + GAMMA * target(s2).max(-1).values
    loss = nn.functional.smooth_l1_loss(q(s).gather(1, a[:, None]).squeeze(1), goal)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 8 == 0:
        target.load_state_dict(q.state_dict())
    if step % 20 == 0:
        print(f"step {step} loss {loss.item():.4f} buffer {len(buffer)}")
print("done", STEPS, "buffer", len(buffer))
