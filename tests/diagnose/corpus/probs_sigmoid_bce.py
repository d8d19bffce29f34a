import torch
import torch.nn as nn


class Detector(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 1))

    def forward(self, x):
        return torch.sigmoid(self.body(x))


torch.manual_seed(0)
model = Detector()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(64, 10)
y = (x.sum(dim=1, keepdim=True) > 0).float()
loss_fn = nn.BCEWithLogitsLoss()
for step in range(10):
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
print(loss.item())
