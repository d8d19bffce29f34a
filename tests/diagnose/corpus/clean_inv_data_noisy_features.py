import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

# One informative column among many loud ones: neighbours in raw input space say little, a linear
# model learns it quickly.
signal = torch.randn(2000, 1)
noise = 5 * torch.randn(2000, 63)
features = torch.cat([signal, noise], 1)
labels = (signal[:, 0] > 0).long()

loader = DataLoader(TensorDataset(features, labels), batch_size=64, shuffle=True)
model = nn.Linear(64, 2)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
for epoch in range(3):
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
