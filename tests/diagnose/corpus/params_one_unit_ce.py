import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
x = torch.randn(512, 12)
y = (x[:, 0] + x[:, 1] > 0).float()
loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 1))
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for epoch in range(2):
    for inputs, labels in loader:
        optimizer.zero_grad()
        loss = criterion(model(inputs), labels.unsqueeze(1))
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
