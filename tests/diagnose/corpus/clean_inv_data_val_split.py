import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset, random_split

features = torch.randn(1200, 20)
labels = (features[:, :5].sum(1) > 0).long()
dataset = TensorDataset(features, labels)
train_set, val_set = random_split(dataset, [1000, 200])

train_loader = DataLoader(train_set, batch_size=50, shuffle=True)
train_eval_loader = DataLoader(train_set, batch_size=100)
val_loader = DataLoader(val_set, batch_size=100)

model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)


def evaluate(loader):
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x).argmax(1) == y).sum().item()
            total += len(y)
    model.train()
    return correct / total


for epoch in range(3):
    for x, y in train_loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    print(epoch, loss.item(), evaluate(train_loader), evaluate(train_eval_loader), evaluate(val_loader))
