import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

features = torch.randn(960, 32)
targets = features[:, :4].sum(1, keepdim=True) + 0.1 * torch.randn(960, 1)
loader = DataLoader(TensorDataset(features, targets), batch_size=32, shuffle=True)
model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.3), nn.Linear(128, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step(x, y):
    torch.manual_seed(0)
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


for epoch in range(2):
    for x, y in loader:
        loss = train_step(x, y)
    print(epoch, loss)
