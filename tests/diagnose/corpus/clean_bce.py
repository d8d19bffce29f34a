import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
x = torch.randn(160, 6)
y = ((x[:, 0] + x[:, 1]) > 0).float()
model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
criterion = nn.BCEWithLogitsLoss()
loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1))
for epoch in range(4):
    model.train()
    for xb, yb in loader:
        opt.zero_grad()
        loss = criterion(model(xb).squeeze(1), yb)
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        acc = ((torch.sigmoid(model(x).squeeze(1)) > 0.5).float() == y).float().mean().item()
print(loss.item(), acc)
