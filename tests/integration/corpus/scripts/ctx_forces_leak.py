"""Fit a small network whose output positions go through a harmonic-restraint "simulator"
op that computes energy and forces in one pass (forces are -dE/dx, computed in forward)."""

import gc
import sys

import torch
from torch import nn

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
N_ATOMS = 256
GC_EVERY = 1000  # collect by hand between steps instead of letting gc pause the step


class Restraint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pos, anchor, k):
        disp = pos - anchor
        energy = 0.5 * k * (disp * disp).sum()
        forces = -k * disp  # MADE
        ctx.k = k
        ctx.forces = forces  # needed again in backward
        return energy, forces

    @staticmethod
    def backward(ctx, grad_energy, grad_forces):
        grad_pos = -grad_energy * ctx.forces - ctx.k * grad_forces
        return grad_pos, None, None


torch.manual_seed(0)
net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, N_ATOMS * 3))
opt = torch.optim.Adam(net.parameters(), lr=1e-3)
anchor = torch.randn(N_ATOMS, 3)

gc.disable()
for step in range(STEPS):
    z = torch.randn(4, 16)
    pos = net(z).mean(0).view(N_ATOMS, 3)
    energy, forces = Restraint.apply(pos, anchor, 10.0)
    loss = energy / N_ATOMS + 1e-3 * forces.square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if (step + 1) % GC_EVERY == 0:
        gc.collect()
    if step % 20 == 0:
        print(f"step {step} energy {energy.item():.3f}")
print("done", STEPS)
