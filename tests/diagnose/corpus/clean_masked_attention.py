import torch
import torch.nn as nn


class MaskedAttention(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, 2)

    def forward(self, x, pad):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / 4.0
        scores = scores.masked_fill(pad[:, None, :], float("-inf"))
        h = torch.softmax(scores, dim=-1) @ v
        return self.out(h.mean(dim=1))


torch.manual_seed(0)
model = MaskedAttention()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(24, 6, 16)
pad = torch.zeros(24, 6, dtype=torch.bool)
pad[:, 4:] = True
causal = torch.full((6, 6), float("-inf")).triu(1)
y = torch.randint(0, 2, (24,))
for step in range(15):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x + causal.exp().sum(), pad), y)
    loss.backward()
    opt.step()
print(loss.item())
