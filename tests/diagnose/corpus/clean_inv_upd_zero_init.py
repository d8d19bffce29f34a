import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class Adapter(nn.Module):
    def __init__(self, dim, rank=4):
        super().__init__()
        self.down = nn.Linear(dim, rank, bias=False)
        self.up = nn.Linear(rank, dim, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, x):
        return x + self.up(self.down(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.adapter = Adapter(64)
        self.head = nn.Linear(64, 3)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x):
        return self.head(self.adapter(self.body(x)))


torch.manual_seed(0)
x_all = torch.randn(640, 20)
y_all = x_all[:, :3].argmax(1)
loader = DataLoader(TensorDataset(x_all, y_all), batch_size=32, shuffle=True)
model = Net()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for epoch in range(5):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
