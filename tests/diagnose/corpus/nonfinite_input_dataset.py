import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class Sensors(Dataset):
    def __init__(self, n=200):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 10, generator=g)
        self.x[17, 4] = float("nan")
        self.x[130, 2] = float("nan")
        self.y = self.x[:, :3].sum(dim=1, keepdim=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(Sensors(), batch_size=20, shuffle=False)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    print(epoch, loss.item())
