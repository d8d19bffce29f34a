import torch
import torch.nn as nn

torch.manual_seed(0)
layers = []
for i in range(10):
    layers += [nn.Linear(64, 64), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear(64, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
for step in range(400):
    opt.zero_grad(set_to_none=False)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    if step % 100 == 0:
        print(step, loss.item())
