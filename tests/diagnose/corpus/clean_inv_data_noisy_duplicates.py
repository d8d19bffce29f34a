import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class Passengers(Dataset):
    """Few categorical columns: many passengers share every feature, and not their fate."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x = torch.stack(
            [torch.randint(0, 3, (n,), generator=g), torch.randint(0, 2, (n,), generator=g),
             torch.randint(0, 4, (n,), generator=g)], 1).float()
        risk = 0.2 + 0.2 * self.x[:, 0] + 0.3 * self.x[:, 1] - 0.05 * self.x[:, 2]
        self.y = (torch.rand(n, generator=g) < risk).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


loader = DataLoader(Passengers(800), batch_size=32, shuffle=True)
model = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
for epoch in range(3):
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
