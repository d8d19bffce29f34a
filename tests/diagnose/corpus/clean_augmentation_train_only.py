import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class RandomHorizontalFlip:
    def __init__(self, p=0.5):
        self.p = p

    def __call__(self, img):
        return img.flip(-1) if torch.rand(1).item() < self.p else img


class RandomCrop:
    def __init__(self, size, padding):
        self.size, self.padding = size, padding

    def __call__(self, img):
        img = nn.functional.pad(img, [self.padding] * 4)
        i, j = torch.randint(0, 2 * self.padding + 1, (2,)).tolist()
        return img[:, i:i + self.size, j:j + self.size]


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, img):
        for t in self.transforms:
            img = t(img)
        return img


class Images(Dataset):
    def __init__(self, n, seed, transform=None):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(n, 3, 16, 16, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.transform = transform

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        img = self.x[i]
        return (self.transform(img) if self.transform else img), self.y[i]


torch.manual_seed(0)
train_transform = Compose([RandomCrop(16, padding=2), RandomHorizontalFlip()])
train_loader = DataLoader(Images(512, 1, train_transform), batch_size=32, shuffle=True)
val_loader = DataLoader(Images(128, 2), batch_size=64)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for epoch in range(2):
    model.train()
    for images, labels in train_loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
    model.eval()
    correct = 0
    with torch.no_grad():
        for images, labels in val_loader:
            correct += (model(images).argmax(1) == labels).sum().item()
    print(epoch, loss.item(), correct / 128)
