import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
# Fine-tuning with the batch-norm statistics frozen: the whole model stays in eval mode on purpose.
backbone = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU())
head = nn.Linear(32, 3)
model = nn.Sequential(backbone, head)
model.eval()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(40):
    x = torch.randn(32, 16)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(loss.item())
