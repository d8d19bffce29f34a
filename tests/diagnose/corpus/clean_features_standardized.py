import numpy as np
import torch
import torch.nn as nn

rng = np.random.default_rng(0)
n = 800
area = rng.uniform(400, 4000, n)  # square feet
year = rng.uniform(1950, 2020, n)
rooms = rng.integers(1, 8, n)
price = 50 * area + 1000 * (year - 1950) + 5000 * rooms + rng.normal(0, 1e4, n)
X = torch.tensor(np.stack([area, year, rooms], axis=1), dtype=torch.float32)
X = (X - X.mean(0)) / X.std(0)
y = torch.tensor(price / 1e5, dtype=torch.float32).unsqueeze(1)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for epoch in range(40):
    perm = torch.randperm(n)
    for i in range(0, n, 100):
        idx = perm[i:i + 100]
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(X[idx]), y[idx])
        loss.backward()
        optimizer.step()
print(loss.item())
