import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))
opt = torch.optim.Adam(net.parameters(), lr=1e-3)
loader = DataLoader(TensorDataset(torch.randn(640, 6), torch.randint(0, 3, (640,))), batch_size=16)
losses = []
for x, y in loader:
    opt.zero_grad()
    loss = nn.functional.cross_entropy(net(x), y)
    loss.backward()
    opt.step()
    losses.append(loss)
print(sum(l.item() for l in losses) / len(losses))
