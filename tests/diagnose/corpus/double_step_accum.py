import torch
import torch.nn as nn

ACCUM = 4


def train_step(model, opt, x, y):
    loss = nn.functional.mse_loss(model(x), y) / ACCUM
    loss.backward()
    opt.step()
    return loss.item()


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(24)]
for i, (x, y) in enumerate(data):
    train_step(model, opt, x, y)
    if (i + 1) % ACCUM == 0:
        opt.step()
        opt.zero_grad()
print("done")
