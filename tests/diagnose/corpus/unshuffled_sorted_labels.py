import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class ByClass(Dataset):
    """Samples stored class by class, as a folder per class lists them."""

    def __init__(self, per_class=64, classes=4):
        rng = np.random.RandomState(0)
        self.x = np.concatenate([rng.randn(per_class, 16) + c for c in range(classes)]).astype("float32")
        self.y = np.concatenate([np.full(per_class, c) for c in range(classes)])

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return torch.from_numpy(self.x[i]), int(self.y[i])


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
train_loader = DataLoader(ByClass(), batch_size=16)
for epoch in range(2):
    for images, labels in train_loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
