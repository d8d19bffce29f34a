import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 32)
        self.cls = nn.Linear(32, 4)
        self.reg = nn.Linear(32, 1)

    def forward(self, x):
        return self.cls(torch.relu(self.body(x)))


torch.manual_seed(2)
net = TwoHeads()
optim = torch.optim.SGD(net.parameters(), lr=0.05)
data = TensorDataset(torch.randn(160, 8), torch.randint(0, 4, (160,)))
for epoch in range(2):
    for x, y in DataLoader(data, batch_size=32, shuffle=True):
        optim.zero_grad()
        nn.CrossEntropyLoss()(net(x), y).backward()
        optim.step()
print("ok")
