import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

# counts regressed through a ReLU, multi-label targets through a sigmoid and BCE
x = torch.randn(1024, 12)
counts = (x[:, :3].abs().sum(1, keepdim=True) * 2).round()
tags = (x[:, 3:7] > 0).float()
loader = DataLoader(TensorDataset(x, counts, tags), batch_size=32, shuffle=True)
body = nn.Sequential(nn.Linear(12, 64), nn.ReLU())
count_head = nn.Sequential(nn.Linear(64, 1), nn.ReLU())
tag_head = nn.Sequential(nn.Linear(64, 4), nn.Sigmoid())
params = list(body.parameters()) + list(count_head.parameters()) + list(tag_head.parameters())
optimizer = torch.optim.Adam(params, lr=1e-3)
for epoch in range(3):
    for xb, cb, tb in loader:
        h = body(xb)
        loss = nn.functional.mse_loss(count_head(h), cb) + nn.functional.binary_cross_entropy(tag_head(h), tb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
