import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 3)

    def forward(self, x):
        return self.head(self.body(x))


x = torch.randn(1536, 20)
y = (x[:, :3].argmax(1)).long()
loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
model = Classifier()
model.body.requires_grad_(False)  # a linear probe: the body stays as it is
optimizer = torch.optim.Adam(model.head.parameters(), lr=1e-3)
for epoch in range(3):
    for xb, yb in loader:
        loss = nn.functional.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
