import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.fc1 = nn.Linear(20, 64)
        self.fc2 = nn.Linear(64, 5)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def train(model, loader, optimizer, criterion, epochs):
    for epoch in range(epochs):
        total_loss = 0
        for i, (inputs, labels) in enumerate(loader):
            optimizer.zero_grad()
            outputs = model(inputs)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
            total_loss += loss
        print("epoch %d loss %.4f" % (epoch, total_loss / len(loader)))


torch.manual_seed(1)
data = TensorDataset(torch.randn(128, 20), torch.randint(0, 5, (128,)))
loader = DataLoader(data, batch_size=32, shuffle=True)
model = Net()
train(model, loader, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), nn.CrossEntropyLoss(), epochs=12)
