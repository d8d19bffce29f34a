import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

# Overfitting one batch on purpose: the dataset is one batch, read again every epoch.
images = torch.randint(0, 256, (32, 1, 8, 8), dtype=torch.uint8)
labels = torch.randint(0, 3, (32,))
loader = DataLoader(TensorDataset(images, labels), batch_size=32)

model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 3))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
for epoch in range(30):
    for x, y in loader:
        x = x.float() / 255
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
print(loss.item())
