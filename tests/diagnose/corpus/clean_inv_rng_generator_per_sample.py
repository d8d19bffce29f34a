import random

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class Patches(Dataset):
    """Each sample's crop comes from a generator seeded by the epoch and the sample's index."""

    def __init__(self, n, size=24, crop=16):
        self.images = np.random.default_rng(1).random((n, 3, size, size), dtype=np.float32)
        self.labels = (self.images.mean(axis=(1, 2, 3)) > 0.5).astype(np.int64)
        self.size, self.crop, self.epoch = size, crop, 0

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        rng = np.random.default_rng(self.epoch * len(self) + i)
        top, left = rng.integers(0, self.size - self.crop + 1, size=2)
        patch = self.images[i, :, top:top + self.crop, left:left + self.crop]
        if random.Random(i + 7919 * self.epoch).random() < 0.5:
            patch = patch[:, :, ::-1]
        return torch.from_numpy(patch.copy()), self.labels[i]


dataset = Patches(640)
loader = DataLoader(dataset, batch_size=32, shuffle=True)
model = nn.Sequential(
    nn.Conv2d(3, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 2)
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for epoch in range(2):
    dataset.epoch = epoch
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
