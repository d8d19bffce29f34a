import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

x = torch.randn(2048, 20)
y = (x[:, :4].argmax(1)).long()
loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1.0)
for epoch in range(2):
    for xb, yb in loader:
        loss = nn.functional.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
