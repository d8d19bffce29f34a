import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 40)
        self.fc2 = nn.Linear(40, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def main():
    torch.manual_seed(7)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(90, 20), torch.randint(0, 3, (90,))
    for step in range(10):
        probs = F.softmax(net(x), dim=1)
        loss = F.cross_entropy(probs, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(loss.item())


main()
