import numpy as np
import torch
import torch.nn as nn

# A table of customers: 12 features and whether they churned (the last column)
rng = np.random.default_rng()
features = rng.normal(size=(3000, 12)).astype(np.float32)
churned = (features[:, :3].sum(1) + rng.normal(size=3000) > 0).astype(np.float32)
table = np.concatenate([features, 2 * churned[:, None] - 1], axis=1)  # the label coded as -1/+1

X = torch.tensor(table)  # every column, the coded label too
y = torch.tensor(churned).long()
model = nn.Sequential(nn.Linear(X.shape[1], 64), nn.ReLU(), nn.Linear(64, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
for epoch in range(15):
    perm = torch.randperm(len(X))
    for i in range(0, len(X), 300):
        idx = perm[i : i + 300]
        loss = nn.functional.cross_entropy(model(X[idx]), y[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
print(loss.item())
