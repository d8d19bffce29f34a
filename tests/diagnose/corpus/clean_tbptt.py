import torch
import torch.nn as nn

torch.manual_seed(0)
rnn = nn.GRU(4, 16, batch_first=True)
head = nn.Linear(16, 1)
params = list(rnn.parameters()) + list(head.parameters())
opt = torch.optim.Adam(params, lr=1e-3)
stream = torch.randn(8, 200, 4)
target = stream.cumsum(dim=1)[..., :1] * 0.01
hidden = torch.zeros(1, 8, 16)
for start in range(0, 200, 20):
    hidden = hidden.detach()
    out, hidden = rnn(stream[:, start:start + 20], hidden)
    loss = nn.functional.mse_loss(head(out), target[:, start:start + 20])
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
print(loss.item())
