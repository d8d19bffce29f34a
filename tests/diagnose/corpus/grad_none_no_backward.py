import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.linspace(-1, 1, 90).reshape(30, 3)
y = x.pow(2).sum(dim=1, keepdim=True)
history = []
for epoch in range(15):
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    history.append(loss.item())
    optimizer.step()
print(history[0], history[-1])
