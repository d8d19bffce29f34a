import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

# 8x8 "images" in [0, 1], normalised to [-1, 1] as the transforms usually do
images = torch.rand(640, 1, 8, 8).round()
images = (images - 0.5) / 0.5
loader = DataLoader(TensorDataset(images), batch_size=64, shuffle=True)


class AutoEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU())
        self.decoder = nn.Sequential(nn.Linear(16, 64), nn.Sigmoid())

    def forward(self, x):
        return self.decoder(self.encoder(x)).view(-1, 1, 8, 8)


model = AutoEncoder()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for epoch in range(3):
    for (batch,) in loader:
        recon = model(batch)
        loss = nn.functional.mse_loss(recon, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
