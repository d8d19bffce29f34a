import torch
import torch.nn as nn

torch.manual_seed(0)
layers = []
width = 32
for i in range(14):
    layers += [nn.Linear(16 if i == 0 else width, width), nn.Sigmoid()]
model = nn.Sequential(*layers, nn.Linear(width, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.5)
x = torch.randn(128, 16)
y = (x[:, 0] * x[:, 1] > 0).long()
for step in range(15):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
print("loss", loss.item())
