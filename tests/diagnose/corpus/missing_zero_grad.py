import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.001)
loader = DataLoader(TensorDataset(torch.randn(320, 4), torch.randn(320, 1)), batch_size=32, shuffle=True)
for epoch in range(3):
    running = 0.0
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        running += loss.item()
    print(epoch, running / len(loader))
