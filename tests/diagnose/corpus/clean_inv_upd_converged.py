import torch
import torch.nn as nn

torch.manual_seed(0)
true_w = torch.tensor([[2.0, -3.4, 1.5]])
x = torch.randn(256, 3)
y = x @ true_w.T + 4.2

model = nn.Linear(3, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = nn.MSELoss()

for step in range(400):
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    if step % 100 == 0:
        print(step, loss.item())
print(model.weight.data, model.bias.data)
