import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(nn.Module):
    def __init__(self, n_in=10, hidden=128):
        super().__init__()
        self.hidden = nn.Linear(n_in, hidden)
        self.act = nn.ReLU()
        self.out = nn.Linear(hidden, 1)
        self.hidden.bias.data.fill_(-2.0)

    def forward(self, x):
        return self.out(self.act(self.hidden(x)))


torch.manual_seed(0)
x_all = torch.randn(1024, 10)
y_all = torch.tanh(x_all @ torch.randn(10, 1)) + 0.1 * torch.randn(1024, 1)
loader = DataLoader(TensorDataset(x_all, y_all), batch_size=64, shuffle=True)

model = Regressor()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for epoch in range(10):
    total = 0.0
    for x, y in loader:
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        total += loss.item()
    print(f"epoch {epoch}: {total / len(loader):.4f}")
