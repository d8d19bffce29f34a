import random

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

random.seed(0)
np.random.seed(0)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 2))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
train = DataLoader(TensorDataset(torch.randn(256, 20), torch.randint(0, 2, (256,))), batch_size=32, shuffle=True,
                   generator=torch.Generator().manual_seed(0))
x_val, y_val = torch.randn(64, 20), torch.randint(0, 2, (64,))
for epoch in range(3):
    model.train()
    for x, y in train:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        acc = (model(x_val).argmax(1) == y_val).float().mean().item()
    print(epoch, loss.item(), acc)
