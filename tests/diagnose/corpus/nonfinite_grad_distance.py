import torch
import torch.nn as nn

torch.manual_seed(0)


class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 8)

    def forward(self, a, b):
        ea, eb = self.embed(a), self.embed(b)
        return ((ea - eb) ** 2).sum(dim=1).sqrt()


model = Siamese()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
a = torch.randn(64, 16)
b = a.clone()
b[32:] += 0.5 * torch.randn(32, 16)
same = torch.cat([torch.ones(32), torch.zeros(32)])
for step in range(10):
    opt.zero_grad()
    d = model(a, b)
    loss = (same * d + (1 - same) * torch.relu(1.0 - d)).mean()
    loss.backward()
    opt.step()
    print(step, loss.item())
