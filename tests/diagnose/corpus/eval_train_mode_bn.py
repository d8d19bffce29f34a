import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def main():
    torch.manual_seed(0)
    model = ConvNet()
    train = DataLoader(TensorDataset(torch.randn(128, 1, 8, 8), torch.randint(0, 10, (128,))), batch_size=32, shuffle=True)
    test = DataLoader(TensorDataset(torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))), batch_size=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(2):
        for x, y in train:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        correct = 0
        with torch.inference_mode():
            for x, y in test:
                correct += (model(x).argmax(1) == y).sum().item()
        print(epoch, correct / 64)


if __name__ == "__main__":
    main()
