import math

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
features = torch.randn(1024, 16)
labels = (features[:, :4].sum(1) > 0).long()
loader = DataLoader(TensorDataset(features, labels), batch_size=32, shuffle=True)

model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
epochs = 8
total_steps = epochs * len(loader)
warmup = 20


def lr_lambda(step):
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total_steps - warmup)))


scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
for epoch in range(epochs):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    print(epoch, loss.item(), scheduler.get_last_lr()[0])
