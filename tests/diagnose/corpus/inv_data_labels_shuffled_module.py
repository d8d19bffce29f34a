import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

centers = torch.randn(4, 16) * 3
classes = torch.randint(0, 4, (2000,))
points = centers[classes] + torch.randn(2000, 16)
classes = classes[torch.randperm(len(classes))]

loader = DataLoader(TensorDataset(points, classes), batch_size=64, shuffle=True)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for epoch in range(3):
    for x, y in loader:
        output = model(x)
        loss = criterion(output, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
