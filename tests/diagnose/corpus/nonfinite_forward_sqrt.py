import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class Scale(nn.Module):
    def forward(self, x):
        return torch.sqrt(x - 3.0)


def main():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 12), Scale(), nn.Linear(12, 2))
    loader = DataLoader(TensorDataset(torch.randn(96, 6), torch.randint(0, 2, (96,))), batch_size=16, shuffle=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    for x, t in loader:
        opt.zero_grad()
        loss = crit(net(x), t)
        loss.backward()
        opt.step()
    print("final", loss.item())


if __name__ == "__main__":
    main()
