import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
        self.reg = nn.Linear(32, 1)
        self.cls = nn.Linear(32, 3)

    def forward(self, x):
        h = self.trunk(x)
        return self.reg(h), self.cls(h)


torch.manual_seed(0)
model = TwoHeads()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(
    TensorDataset(torch.randn(256, 10), torch.randn(256, 1), torch.randint(0, 3, (256,))), batch_size=16, shuffle=True
)
for x, y_reg, y_cls in loader:
    optimizer.zero_grad()
    out_reg, out_cls = model(x)
    nn.functional.mse_loss(out_reg, y_reg).backward(retain_graph=True)
    nn.functional.cross_entropy(out_cls, y_cls).backward()
    optimizer.step()
print("done")
