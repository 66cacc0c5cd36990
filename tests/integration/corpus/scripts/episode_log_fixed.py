"""Actor-critic with a recurrent policy on a toy bandit; every step's recurrent state is
logged as numbers with the step for later analysis."""

import sys

import torch
from torch import nn

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
ENVS, OBS, HIDDEN, ACTIONS = 8, 16, 64, 4


class AgentState:
    def __init__(self, h, c):
        self.h = h
        self.c = c


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(OBS, HIDDEN)
        self.logits = nn.Linear(HIDDEN, ACTIONS)
        self.value = nn.Linear(HIDDEN, 1)


torch.manual_seed(0)
policy = Policy()
opt = torch.optim.Adam(policy.parameters(), lr=3e-4)
state = AgentState(torch.zeros(ENVS, HIDDEN), torch.zeros(ENVS, HIDDEN))
episode_log = []
for step in range(STEPS):
    obs = torch.randn(ENVS, OBS)
    h, c = policy.cell(obs, (state.h, state.c))
    dist = torch.distributions.Categorical(logits=policy.logits(h))
    action = dist.sample()
    reward = (action == obs[:, :ACTIONS].argmax(-1)).float()
    value = policy.value(h).squeeze(-1)
    advantage = reward - value
    loss = -(dist.log_prob(action) * advantage.detach()).mean() + advantage.pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    episode_log.append(
        {
            "step": step,
            "reward": reward.mean().item(),
            "state": {"h_norm": h.detach().norm().item(), "c_norm": c.detach().norm().item()},
        }
    )
    state = AgentState(h.detach(), c.detach())
    if step % 20 == 0:
        print(f"step {step} loss {loss.item():.3f}")
print("done", STEPS, "logged", len(episode_log))
