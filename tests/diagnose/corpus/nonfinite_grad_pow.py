import torch
import torch.nn as nn


class SignedRoot(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(n))

    def forward(self, x):
        z = x * self.gain
        return torch.sign(z) * z.abs() ** 0.5


def run():
    torch.manual_seed(4)
    model = nn.Sequential(SignedRoot(12), nn.Linear(12, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = nn.functional.one_hot(torch.randint(0, 12, (100,)), 12).float()
    y = torch.randn(100, 1)
    for it in range(6):
        pred = model(x)
        loss = ((pred - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(it, loss.item())


run()
