import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
x = torch.linspace(-2, 2, 60).reshape(20, 3)
y = torch.sin(x).sum(dim=1, keepdim=True)


def closure():
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss


for step in range(6):
    loss = opt.step(closure)
print(float(loss))
