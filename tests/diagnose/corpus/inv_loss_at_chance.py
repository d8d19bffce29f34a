import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

points = torch.randn(2000, 2)
labels = ((points[:, 0] * points[:, 1]) > 0).long()
loader = DataLoader(TensorDataset(points, labels), batch_size=50, shuffle=True)

model = nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
criterion = nn.CrossEntropyLoss()

inputs, targets = next(iter(loader))
print("batch", inputs.shape, targets.shape)
for epoch in range(4):
    for batch, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        out = model(inputs)
        loss = criterion(out, y)
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
