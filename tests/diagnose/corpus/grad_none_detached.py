import torch
import torch.nn as nn


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        features = self.encoder(x).detach()
        return self.head(features)


torch.manual_seed(0)
model = Classifier()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(128, 12)
y = torch.randint(0, 3, (128,))
for step in range(12):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
print(loss.item())
