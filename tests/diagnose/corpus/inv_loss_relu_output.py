import math

import torch

x = torch.linspace(-math.pi, math.pi, 2000).unsqueeze(1)
y = torch.sin(x)
model = torch.nn.Sequential(torch.nn.Linear(1, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1), torch.nn.ReLU())
loss_fn = torch.nn.MSELoss(reduction="sum")
optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3)
for t in range(300):
    loss = loss_fn(model(x), y)
    if t % 100 == 99:
        print(t, loss.item())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
