import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class Digits(Dataset):
    """8-bit grayscale images as stored on disk, converted to float for the model."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (n, 1, 16, 16), generator=g, dtype=torch.uint8)
        self.labels = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i].float() / 255.0, self.labels[i]


torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16 * 16, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(Digits(512), batch_size=32, shuffle=True)
for epoch in range(2):
    for images, labels in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
