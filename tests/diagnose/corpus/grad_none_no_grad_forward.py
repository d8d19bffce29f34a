import torch
import torch.nn as nn


def train_epoch(model, opt, batches):
    for x, y in batches:
        with torch.no_grad():
            pred = model(x)
        loss = nn.functional.mse_loss(pred, y)
        opt.zero_grad()
        loss.backward()
        opt.step()


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 10), nn.ReLU(), nn.Linear(10, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
batches = [(torch.randn(8, 5), torch.randn(8, 1)) for _ in range(5)]
train_epoch(model, opt, batches)
