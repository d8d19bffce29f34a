import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class Digits(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.images = torch.rand(n, 1, 8, 8, generator=g)
        self.labels = (self.images.mean((1, 2, 3)) * 20).long() % 10

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        j = torch.randint(len(self.labels), ()).item()
        return self.images[i], self.labels[j]


loader = DataLoader(Digits(600), batch_size=32, shuffle=True)
model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for epoch in range(3):
    for images, labels in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
