import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class TripletLoss(nn.Module):
    def __init__(self, margin=0.5):
        super().__init__()
        self.margin = margin

    def forward(self, anchor, positive, negative):
        d_pos = (anchor - positive).pow(2).sum(1)
        d_neg = (anchor - negative).pow(2).sum(1)
        return F.relu(d_pos - d_neg + self.margin).mean()


torch.manual_seed(0)
centers = torch.randn(8, 16) * 3
labels = torch.randint(0, 8, (1024,))
points = centers[labels] + torch.randn(1024, 16)
loader = DataLoader(TensorDataset(points, labels), batch_size=64, shuffle=True)
encoder = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
criterion = TripletLoss()
optimizer = torch.optim.Adam(encoder.parameters(), lr=1e-3)
for epoch in range(6):
    for x, y in loader:
        same = (y[:, None] == y[None, :]).float().fill_diagonal_(0)
        pos = torch.multinomial(same + 1e-6, 1).squeeze(1)
        neg = torch.multinomial(1 - same - torch.eye(len(y)) + 1e-6, 1).squeeze(1)
        emb = encoder(x)
        loss = criterion(emb, emb[pos], emb[neg])
        hinge = torch.relu(0.2 - (emb[:, None] - emb[None]).pow(2).sum(-1)).mean()
        optimizer.zero_grad()
        (loss + 0.1 * hinge).backward()
        optimizer.step()
    print(epoch, loss.item())
