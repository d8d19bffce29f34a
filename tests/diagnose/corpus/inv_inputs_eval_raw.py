import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

# pixel-like features in [0, 255]
x = torch.randint(0, 256, (3000, 64)).float()
y = (x[:, :8].mean(1) > 127.5).long()
train = DataLoader(TensorDataset(x[:2500], y[:2500]), batch_size=50, shuffle=True)
test = DataLoader(TensorDataset(x[2500:], y[2500:]), batch_size=100)
mean, std = x[:2500].mean(), x[:2500].std()
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for epoch in range(3):
    for xb, yb in train:
        xb = (xb - mean) / std
        loss = nn.functional.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    correct = 0
    with torch.no_grad():
        for xb, yb in test:
            correct += (model(xb).argmax(1) == yb).sum().item()
    print(epoch, loss.item(), correct / 500)
