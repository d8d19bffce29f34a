import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

x = torch.randn(2048, 32)
y = (x[:, :5].sum(1) > 0).long()
loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
keep_prob = 0.9
model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Dropout(keep_prob), nn.Linear(128, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for epoch in range(3):
    model.train()
    for xb, yb in loader:
        loss = nn.functional.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
