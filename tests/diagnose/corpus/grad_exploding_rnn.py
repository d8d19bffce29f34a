import torch
import torch.nn as nn


class Recurrent(nn.Module):
    def __init__(self, n=16):
        super().__init__()
        self.inp = nn.Linear(4, n)
        self.rec = nn.Linear(n, n, bias=False)
        with torch.no_grad():
            self.rec.weight.copy_(torch.eye(n) * 2.5 + 0.1 * torch.randn(n, n))
        self.out = nn.Linear(n, 1)

    def forward(self, seq):
        h = torch.zeros(seq.shape[0], self.rec.weight.shape[0])
        for t in range(seq.shape[1]):
            h = self.rec(h) + self.inp(seq[:, t])
        return self.out(h)


torch.manual_seed(0)
model = Recurrent()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
seq = torch.randn(32, 25, 4)
target = torch.randn(32, 1)
for step in range(6):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(seq), target)
    loss.backward()
    opt.step()
    print(step, loss.item())
