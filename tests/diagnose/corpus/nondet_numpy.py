import random

import numpy as np
import torch
import torch.nn as nn

random.seed(0)
torch.manual_seed(0)
model = nn.Linear(5, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(10):
    x = torch.from_numpy(np.random.rand(32, 5).astype("float32"))
    y = x.sum(dim=1, keepdim=True)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
print(loss.item())
