import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

# XOR-like classes: no linear boundary separates them
x = torch.randn(2048, 10)
y = ((x[:, 0] > 0) ^ (x[:, 1] > 0)).long()
loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(10, 128)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(128, 2)

    def forward(self, x):
        return self.out(self.drop(self.hidden(x)))


model = MLP()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for epoch in range(3):
    for xb, yb in loader:
        loss = nn.functional.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
