import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

points = torch.randn(640, 16)
loader = DataLoader(TensorDataset(points), batch_size=32, shuffle=True)
encoder = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))
optimizer = torch.optim.Adam(encoder.parameters(), lr=1e-3)
queue = F.normalize(torch.randn(256, 32), dim=1)
for epoch in range(2):
    for (x,) in loader:
        q = F.normalize(encoder(x + 0.1 * torch.randn_like(x)), dim=1)
        with torch.no_grad():
            k = F.normalize(encoder(x + 0.1 * torch.randn_like(x)), dim=1)
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ queue.t()], dim=1) / 0.2
        labels = torch.zeros(len(x), dtype=torch.long)
        loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        queue = torch.cat([k, queue])[:256]
    print(epoch, loss.item())
