import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
x = torch.randn(1024, 20)
y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
train_loader = DataLoader(TensorDataset(x[:896], y[:896]), batch_size=32, shuffle=True)
val_loader = DataLoader(TensorDataset(x[896:], y[896:]), batch_size=64)


def evaluate():
    model.eval()
    correct = 0
    with torch.no_grad():
        for inputs, targets in val_loader:
            correct += (model(inputs).argmax(1) == targets).sum().item()
    return correct / 128


model.train()
for epoch in range(3):
    for inputs, targets in train_loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
    print(epoch, loss.item(), evaluate())
