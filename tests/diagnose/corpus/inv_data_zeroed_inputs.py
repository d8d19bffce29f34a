import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class Scans(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.pixels = torch.randint(0, 255, (n, 1, 16, 16), dtype=torch.uint8, generator=g)
        self.labels = (self.pixels.float().mean((1, 2, 3)) > 127).long()

    def __len__(self):
        return len(self.pixels)

    def __getitem__(self, i):
        image = self.pixels[i].float() // 255
        return image, self.labels[i]


loader = DataLoader(Scans(512), batch_size=32, shuffle=True)
model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(128, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for epoch in range(2):
    for images, labels in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
