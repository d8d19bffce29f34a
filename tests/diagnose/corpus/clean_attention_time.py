import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class TimeAttention(nn.Module):
    """Attention over time steps of a (time, batch, features) sequence: the softmax is over dim 0."""

    def __init__(self, d):
        super().__init__()
        self.rnn = nn.GRU(d, 32)
        self.score = nn.Linear(32, 1)
        self.head = nn.Linear(32, 3)

    def forward(self, seq):
        out, _ = self.rnn(seq)  # (time, batch, 32)
        weights = F.softmax(self.score(out).squeeze(-1), dim=0)  # (time, batch)
        return self.head((weights.unsqueeze(-1) * out).sum(0))


model = TimeAttention(8)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(30):
    seq = torch.randn(12, 16, 8)
    target = torch.randint(0, 3, (16,))
    loss = F.cross_entropy(model(seq), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
print(loss.item())
