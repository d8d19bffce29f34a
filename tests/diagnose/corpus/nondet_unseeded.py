import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.arange(512, dtype=torch.float32).reshape(64, 8) / 512, torch.arange(64) % 2)
for x, y in DataLoader(data, batch_size=8, shuffle=True):
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
print(loss.item())
