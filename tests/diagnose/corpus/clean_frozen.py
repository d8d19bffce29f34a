import torch
import torch.nn as nn


class FineTune(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 3)
        self.temperature = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.head(self.backbone(x)) / self.temperature


torch.manual_seed(0)
model = FineTune()
for p in model.backbone.parameters():
    p.requires_grad_(False)
opt = torch.optim.AdamW(model.head.parameters(), lr=1e-3)
x, y = torch.randn(128, 12), torch.randint(0, 3, (128,))
for step in range(15):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
print(loss.item())
