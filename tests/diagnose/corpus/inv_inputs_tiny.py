import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

weights = torch.randn(12)
features = torch.randn(4096, 12)
targets = (features @ weights > 0).long()
features = features / 1000  # millimetres to metres
loader = DataLoader(TensorDataset(features, targets), batch_size=128, shuffle=True)

model = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(3):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
