import math

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class Spectra(Dataset):
    def __len__(self):
        return 320

    def __getitem__(self, i):
        values = []
        for k in range(2400):
            values.append(sum(math.sin(i * k * j * 1e-3) for j in range(8)))
        x = torch.tensor(values[:64], dtype=torch.float32)
        return x, torch.tensor(float(i % 2))


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x, y in DataLoader(Spectra(), batch_size=32):
    opt.zero_grad()
    nn.functional.mse_loss(model(x).squeeze(1), y).backward()
    opt.step()
print("done")
