import torch
import torch.nn as nn

x = torch.randn(2048, 20)
y = x[:, :3].sum(1, keepdim=True)
model = nn.Sequential(nn.Linear(20, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 1))
for m in model:
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=1.0)
        nn.init.zeros_(m.bias)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
for it in range(300):
    i = torch.randint(0, 2048, (64,))
    loss = nn.functional.mse_loss(model(x[i]), y[i])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if it % 100 == 0:
        print(it, loss.item())
