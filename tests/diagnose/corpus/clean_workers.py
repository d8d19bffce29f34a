import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class Shapes(Dataset):
    def __init__(self, n=192):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 1, 8, 8, generator=g)
        self.y = (self.x.mean(dim=(1, 2, 3)) > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(4 * 64, 2)

    def forward(self, x):
        return self.fc(self.drop(torch.relu(self.bn(self.conv(x))).flatten(1)))


def main():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(Shapes(), batch_size=32, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(0))
    for epoch in range(2):
        model.train()
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        model.eval()
        with torch.inference_mode():
            acc = sum((model(x).argmax(1) == y).sum().item() for x, y in loader) / 192
        print(epoch, acc)


if __name__ == "__main__":
    main()
