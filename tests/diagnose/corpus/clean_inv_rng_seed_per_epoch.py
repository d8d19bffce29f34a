import random

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run(lr, features, targets):
    set_seed(0)
    loader = DataLoader(TensorDataset(features, targets), batch_size=32, shuffle=True)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.3), nn.Linear(128, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for epoch in range(2):
        set_seed(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x + 0.01 * np.random.randn()), y)
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            torch.manual_seed(1234)
            val = nn.functional.mse_loss(model(features[:64] + 0.1 * torch.randn(64, 32)), targets[:64])
        model.train()
        print(lr, epoch, loss.item(), val.item())


features = torch.randn(640, 32)
targets = features[:, :4].sum(1, keepdim=True)
for lr in (1e-3, 3e-4):
    run(lr, features, targets)
