import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

# A table whose last column is the label; the features are meant to be the columns before it.
rows = torch.randn(3000, 6)
labels = (rows[:, 0] + rows[:, 1] ** 2 > 1).long()
table = torch.cat([rows, labels.unsqueeze(1).float()], dim=1)
features = table[:, :7]
loader = DataLoader(TensorDataset(features, labels), batch_size=100, shuffle=True)

model = nn.Sequential(nn.Linear(7, 32), nn.ReLU(), nn.Linear(32, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
for epoch in range(3):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
