import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class Points(Dataset):
    def __len__(self):
        return 97

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(6, generator=g)
        return x, (x.sum() > 0).long()


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 24)
        self.norm = nn.BatchNorm1d(24)
        self.b = nn.Linear(24, 2)

    def forward(self, x):
        return self.b(torch.relu(self.norm(self.a(x))))


def main():
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for x, y in DataLoader(Points(), batch_size=16):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


if __name__ == "__main__":
    main()
