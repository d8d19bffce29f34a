import torch
import torch.nn as nn

torch.manual_seed(0)
X = torch.randn(512, 20) * 10
w_true = torch.randn(20, 1)
y = X @ w_true
model = nn.Sequential(nn.Linear(20, 64), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for epoch in range(40):
    perm = torch.randperm(512)
    for i in range(0, 512, 128):
        idx = perm[i:i + 128]
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(X[idx]), y[idx])
        loss.backward()
        opt.step()
    if epoch % 10 == 0:
        print(epoch, loss.item())
