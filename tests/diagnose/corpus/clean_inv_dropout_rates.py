import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 128)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(128, 2)

    def forward(self, x):
        x = F.dropout(x, p=0.2, training=self.training)
        return self.fc2(self.drop(F.relu(self.fc1(x))))


x = torch.randn(2048, 32)
y = (x[:, :5].sum(1) > 0).long()
loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
model = Net()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for epoch in range(3):
    model.train()
    for xb, yb in loader:
        loss = F.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        print(epoch, (model(x).argmax(1) == y).float().mean().item())
