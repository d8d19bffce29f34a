import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
data = torch.randint(0, 50, (5000,))
model = nn.Sequential(nn.Embedding(50, 32), nn.Dropout(0.2), nn.Linear(32, 50))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)


def get_batch():
    ix = torch.randint(len(data) - 1, (32,))
    return data[ix], data[ix + 1]


@torch.no_grad()
def estimate_loss():
    model.eval()
    losses = torch.zeros(5)
    for k in range(5):
        x, y = get_batch()
        losses[k] = F.cross_entropy(model(x), y).item()
    return losses.mean()


for iter_num in range(60):
    if iter_num % 20 == 0:
        print(iter_num, estimate_loss().item())
    x, y = get_batch()
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
