import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

# normalised once in the data; noise augmentation in training only
x = torch.randint(0, 256, (3000, 64)).float()
y = (x[:, :8].mean(1) > 127.5).long()
x = (x - x.mean()) / x.std()
train = DataLoader(TensorDataset(x[:2500], y[:2500]), batch_size=50, shuffle=True)
test = DataLoader(TensorDataset(x[2500:], y[2500:]), batch_size=100)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for epoch in range(3):
    model.train()
    for xb, yb in train:
        xb = xb + 0.5 * torch.randn_like(xb)
        loss = nn.functional.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    correct = 0
    with torch.no_grad():
        for xb, yb in test:
            correct += (model(xb).argmax(1) == yb).sum().item()
    print(epoch, loss.item(), correct / 500)
