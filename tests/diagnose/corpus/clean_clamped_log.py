import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def focal(probs, target, gamma=2.0):
    p = probs.gather(1, target.unsqueeze(1)).squeeze(1)
    return (-(1 - p) ** gamma * torch.log(p.clamp_min(1e-8))).mean()


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
loader = DataLoader(TensorDataset(torch.randn(65, 10), torch.randint(0, 4, (65,))), batch_size=32, shuffle=True,
                    drop_last=True)
for epoch in range(3):
    for x, y in loader:
        opt.zero_grad()
        loss = focal(model(x).softmax(dim=1), y)
        loss.backward()
        opt.step()
print(loss.item())
