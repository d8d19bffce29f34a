import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

# a frozen base layer with a trainable low-rank adapter (LoRA's B(A(x))), and a GELU MLP head
x = torch.randn(2048, 32)
y = ((x[:, 0] > 0) ^ (x[:, 1] > 0)).long()
loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)


class Adapted(nn.Module):
    def __init__(self, rank=4):
        super().__init__()
        self.base = nn.Linear(32, 32)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(32, rank, bias=False)
        self.lora_b = nn.Linear(rank, 32, bias=False)
        nn.init.zeros_(self.lora_b.weight)
        self.head = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 2))

    def forward(self, x):
        h = self.base(x) + self.lora_b(self.lora_a(x))
        return self.head(h)


model = Adapted()
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
for epoch in range(3):
    for xb, yb in loader:
        loss = nn.functional.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
