import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--epochs", type=int, default=4)
args = parser.parse_args()

torch.manual_seed(0)
features = torch.randn(512, 16)
labels = (features[:, :4].sum(1) > 0).long()
loader = DataLoader(TensorDataset(features, labels), batch_size=32, shuffle=True)

model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

for epoch in range(args.epochs):
    total = 0.0
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), args.lr)
        optimizer.step()
        total += loss.item()
    print(f"epoch {epoch}: loss {total / len(loader):.4f}")
