from collections import deque

import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
recent = deque(maxlen=5)
total = 0.0
for step in range(40):
    x, y = torch.randn(16, 10), torch.randn(16, 1)
    opt.zero_grad()
    pred = model(x)
    loss = nn.functional.mse_loss(pred, y)
    loss.backward()
    opt.step()
    total += loss.item()
    recent.append(pred.detach())
print(total / 40, torch.cat(list(recent)).mean().item())
