import torch
import torch.nn as nn


class Logger:
    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.lrs = []

    def log(self, loss):
        self.optimizer.step()
        self.lrs.append(self.optimizer.param_groups[0]["lr"])
        print(f"loss={loss:.4f}")


torch.manual_seed(3)
model = nn.Linear(10, 2)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
logger = Logger(optimizer)
for step in range(10):
    x, y = torch.randn(32, 10), torch.randint(0, 2, (32,))
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    logger.log(loss.item())
