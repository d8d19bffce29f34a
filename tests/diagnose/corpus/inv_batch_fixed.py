import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

centers = torch.randn(4, 16) * 2
labels = torch.randint(0, 4, (2048,))
points = centers[labels] + torch.randn(2048, 16)
loader = DataLoader(TensorDataset(points, labels), batch_size=64, shuffle=True)

model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
sample_x, sample_y = next(iter(loader))  # one batch to look at the shapes

for epoch in range(2):
    for x, y in loader:
        x, y = sample_x, sample_y
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
