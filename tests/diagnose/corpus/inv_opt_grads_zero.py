import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

x = torch.randn(2048, 20)
y = (x[:, :3].sum(1) > 0).long()
loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)


class BinaryCodeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(20, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        code = torch.round(torch.sigmoid(self.encoder(x)))  # a binary code of the input
        return self.head(code)


model = BinaryCodeNet()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for epoch in range(3):
    for xb, yb in loader:
        loss = nn.functional.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
