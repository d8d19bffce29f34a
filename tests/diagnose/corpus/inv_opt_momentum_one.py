import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

x = torch.randn(1024, 10)
y = x @ torch.randn(10, 1) + 0.1 * torch.randn(1024, 1)
loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))
# "no dampening, full momentum"
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=1.0)
for epoch in range(3):
    for xb, yb in loader:
        loss = nn.functional.mse_loss(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
