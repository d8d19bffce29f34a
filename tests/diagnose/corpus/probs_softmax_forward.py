import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 48), nn.Linear(48, 6)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        return F.softmax(self.fc2(x), dim=1)


torch.manual_seed(0)
model = Net()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(240, 12)
y = x[:, :6].argmax(dim=1)
for epoch in range(3):
    for i in range(0, 240, 40):
        opt.zero_grad()
        out = model(x[i:i + 40])
        loss = F.cross_entropy(out, y[i:i + 40])
        loss.backward()
        opt.step()
