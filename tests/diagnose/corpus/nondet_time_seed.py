import time

import torch
import torch.nn as nn

seed = int(time.time() * 1e6) % (2 ** 31)
torch.manual_seed(seed)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x, y = torch.randn(32, 4), torch.randn(32, 1)
for step in range(8):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
print(seed, loss.item())
