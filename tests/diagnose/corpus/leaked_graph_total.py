import torch
import torch.nn as nn


def train(model, opt, batches):
    total_loss = 0
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        total_loss += loss
    return total_loss / len(batches)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batches = [(torch.randn(16, 10), torch.randn(16, 1)) for _ in range(40)]
print("mean loss", float(train(model, opt, batches)))
