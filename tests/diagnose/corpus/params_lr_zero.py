import torch
import torch.nn as nn

BASE_LR = 0.1
WARMUP = 100

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=BASE_LR)
x, y = torch.randn(128, 6), torch.randn(128, 1)
for step in range(20):
    for g in opt.param_groups:
        g["lr"] = BASE_LR * (step // WARMUP)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
print(loss.item())
