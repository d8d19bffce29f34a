import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
backbone = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
head = nn.Linear(32, 4)
model = nn.Sequential(backbone, head)
x = torch.randn(512, 16)
y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)


def run(optimizer, epochs):
    for _ in range(epochs):
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
    return loss.item()


# Stage 1: everything trains.
stage1 = torch.optim.Adam(model.parameters(), lr=1e-3)
print("stage 1", run(stage1, 2))
# Stage 2: the backbone is frozen, a new optimizer fine-tunes the head at a lower rate.
for p in backbone.parameters():
    p.requires_grad = False
stage2 = torch.optim.SGD(head.parameters(), lr=1e-2, momentum=0.9)
print("stage 2", run(stage2, 2))
