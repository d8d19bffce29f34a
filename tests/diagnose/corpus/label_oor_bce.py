import torch
import torch.nn as nn

torch.manual_seed(0)
x = torch.randn(120, 6)
severity = (x[:, 0] > 0).float() + (x[:, 1] > 1).float()
model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
criterion = nn.BCEWithLogitsLoss()
for epoch in range(10):
    opt.zero_grad()
    loss = criterion(model(x).squeeze(1), severity)
    loss.backward()
    opt.step()
print(loss.item())
