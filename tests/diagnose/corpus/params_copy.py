import copy

import torch
import torch.nn as nn


def build():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


torch.manual_seed(0)
model = build()
ema = copy.deepcopy(model)
opt = torch.optim.Adam(ema.parameters(), lr=1e-3)
x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
for step in range(10):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
print(loss.item())
