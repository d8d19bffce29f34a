import torch
import torch.nn as nn

torch.manual_seed(1)
model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)


def masked_mse(pred, target, mask):
    err = ((pred - target) ** 2 * mask).sum()
    return err / mask.sum()


X = torch.randn(128, 4)
y = torch.randn(128, 1)
weights = (torch.rand(128, 1) > 0.5).float()
weights[64:] = 0.0
for step in range(8):
    idx = slice((step % 4) * 32, (step % 4) * 32 + 32)
    opt.zero_grad()
    loss = masked_mse(model(X[idx]), y[idx], weights[idx])
    loss.backward()
    opt.step()
    print(step, float(loss))
