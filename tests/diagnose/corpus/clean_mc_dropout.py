import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.dropout(x, 0.5, training=True)  # Monte Carlo dropout: sampled in evaluation too
        return self.fc2(x)


def evaluate(model, loader):
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x).argmax(1) == y).sum().item()
    return correct / len(loader.dataset)


torch.manual_seed(0)
train_data = TensorDataset(torch.randn(256, 32), torch.randint(0, 4, (256,)))
test_data = TensorDataset(torch.randn(64, 32), torch.randint(0, 4, (64,)))
model = Net()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for epoch in range(2):
    model.train()
    for x, y in DataLoader(train_data, batch_size=32, shuffle=True):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    print("accuracy", evaluate(model, DataLoader(test_data, batch_size=64)))
