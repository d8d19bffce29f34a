import torch
import torch.nn as nn

x = torch.randn(1024, 20)
y = (x[:, :3].sum(1) > 0).long()
model = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 2))
learning_rate = 0.01
for it in range(300):
    i = torch.randint(0, 1024, (32,))
    loss = nn.functional.cross_entropy(model(x[i]), y[i])
    model.zero_grad()
    loss.backward()
    for p in model.parameters():
        p.data.add_(p.grad.data, alpha=learning_rate)
    if it % 100 == 0:
        print(it, loss.item())
