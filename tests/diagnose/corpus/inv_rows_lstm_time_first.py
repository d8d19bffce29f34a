import math

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

# Accelerometer windows (3 axes, 24 readings) of three activities, told apart by their rhythm
labels = torch.randint(0, 3, (900,))
t = torch.arange(24) / 24
rhythm = torch.stack([torch.sin(2 * math.pi * f * t) for f in (1.0, 2.0, 4.0)])
windows = rhythm[labels].unsqueeze(-1).expand(-1, -1, 3) + 0.3 * torch.randn(900, 24, 3)
loader = DataLoader(TensorDataset(windows, labels), batch_size=32, shuffle=True)


class ActivityNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(input_size=3, hidden_size=32, num_layers=2)
        self.fc = nn.Linear(32, 3)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.fc(out[:, -1, :])


model = ActivityNet()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for epoch in range(4):
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    print(f"epoch {epoch}: loss {loss.item():.3f}")
