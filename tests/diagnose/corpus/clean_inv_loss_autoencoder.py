import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

# 8x8 "images" in [0, 1] made of a few strokes; the decoder ends in a sigmoid
basis = torch.rand(6, 64)
images = (torch.rand(1280, 6) @ basis / 3).clamp(0, 1).view(-1, 1, 8, 8)
loader = DataLoader(TensorDataset(images), batch_size=64, shuffle=True)


class AutoEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU())
        self.decoder = nn.Sequential(nn.Linear(16, 64), nn.Sigmoid())

    def forward(self, x):
        return self.decoder(self.encoder(x)).view(-1, 1, 8, 8)


model = AutoEncoder()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
for epoch in range(6):
    for (batch,) in loader:
        recon = model(batch)
        loss = nn.functional.mse_loss(recon, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
