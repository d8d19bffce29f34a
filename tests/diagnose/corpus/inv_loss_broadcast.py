import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

# House prices from 8 features: a regression
features = torch.randn(512, 8)
prices = features @ torch.linspace(-1, 1, 8) + 0.1 * torch.randn(512)
loader = DataLoader(TensorDataset(features, prices), batch_size=32, shuffle=True)

model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
criterion = nn.MSELoss()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for epoch in range(3):
    for x, y in loader:
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
    print(f"epoch {epoch}: {loss.item():.4f}")
