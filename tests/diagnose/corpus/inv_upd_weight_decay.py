import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
x_all = torch.rand(512, 8) * 2 - 1
y_all = torch.sin(3 * x_all[:, :1]) + x_all[:, 1:2] * x_all[:, 2:3]
loader = DataLoader(TensorDataset(x_all, y_all), batch_size=32, shuffle=True)

model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=10)

for epoch in range(4):
    total = 0.0
    for x, y in loader:
        pred = model(x)
        loss = ((pred - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += loss.item()
    print(f"epoch {epoch}: mse {total / len(loader):.4f}")
