import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class MLP(nn.Module):
    def __init__(self, n_in=20, hidden=64, n_out=3):
        super().__init__()
        self.fc1 = nn.Linear(n_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, n_out)
        self.apply(self._init_weights)

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            nn.init.constant_(m.weight, 0.05)
            nn.init.zeros_(m.bias)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.out(x)


torch.manual_seed(0)
centers = torch.randn(3, 20) * 2
y_all = torch.randint(0, 3, (640,))
x_all = centers[y_all] + torch.randn(640, 20)
loader = DataLoader(TensorDataset(x_all, y_all), batch_size=32, shuffle=True)
model = MLP()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
criterion = nn.CrossEntropyLoss()
for epoch in range(5):
    correct = 0
    for x, y in loader:
        logits = model(x)
        loss = criterion(logits, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        correct += (logits.argmax(1) == y).sum().item()
    print(f"epoch {epoch} loss {loss.item():.3f} acc {correct / len(x_all):.3f}")
