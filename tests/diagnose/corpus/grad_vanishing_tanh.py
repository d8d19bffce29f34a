import torch
import torch.nn as nn


class Deep(nn.Module):
    def __init__(self, depth=12):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(24, 24) for _ in range(depth))
        for b in self.blocks:
            nn.init.normal_(b.weight, std=0.02)
        self.out = nn.Linear(24, 1)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.out(x)


torch.manual_seed(5)
model = Deep()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(64, 24), torch.randn(64, 1)
for step in range(10):
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
print(loss.item())
