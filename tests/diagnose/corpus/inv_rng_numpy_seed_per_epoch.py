import numpy as np
import torch
import torch.nn as nn


def set_seed(seed=42):
    np.random.seed(seed)
    torch.manual_seed(seed)


def batches(x, y, batch_size):
    order = np.random.permutation(len(x))
    for start in range(0, len(x), batch_size):
        idx = order[start:start + batch_size]
        noise = np.random.normal(0, 0.05, size=x[idx].shape).astype(np.float32)
        yield torch.from_numpy(x[idx] + noise), torch.from_numpy(y[idx])


x = np.random.randn(800, 12).astype(np.float32)
y = (x[:, 0] > 0).astype(np.int64)
model = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(3):
    set_seed()
    for xb, yb in batches(x, y, 50):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
