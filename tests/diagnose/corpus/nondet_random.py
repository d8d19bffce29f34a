import random

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

torch.manual_seed(0)


class Jitter(Dataset):
    def __init__(self):
        self.x = torch.randn(128, 8)
        self.y = torch.randint(0, 2, (128,))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + random.gauss(0.0, 0.1), self.y[i]


model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in DataLoader(Jitter(), batch_size=16, shuffle=True):
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
print("done")
