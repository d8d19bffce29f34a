import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

x = torch.randn(2048, 20)
y = (x[:, :3].sum(1) > 0).long()
train = DataLoader(TensorDataset(x[:1800], y[:1800]), batch_size=64, shuffle=True)
val = DataLoader(TensorDataset(x[1800:], y[1800:]), batch_size=256)
model = nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)


def evaluate():
    model.eval()
    with torch.no_grad():
        return sum((model(xb).argmax(1) == yb).sum().item() for xb, yb in val) / 248


evaluate()  # accuracy before training
for epoch in range(3):
    for xb, yb in train:
        loss = nn.functional.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, loss.item(), evaluate())
