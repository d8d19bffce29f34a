import os
import tempfile

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class ConvNet(nn.Module):
    def __init__(self, num_classes=10):
        super(ConvNet, self).__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.layer2 = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.fc = nn.Linear(4 * 4 * 16, num_classes)

    def forward(self, x):
        out = self.layer2(self.layer1(x))
        return self.fc(out.reshape(out.size(0), -1))


torch.manual_seed(0)
pretrained = os.path.join(tempfile.mkdtemp(), "pretrained.pt")
torch.save(ConvNet().state_dict(), pretrained)

model = ConvNet()
model.load_state_dict(torch.load(pretrained))
for param in model.parameters():
    param.requires_grad = False
model.fc = nn.Linear(4 * 4 * 16, 10)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
loader = DataLoader(TensorDataset(torch.randn(256, 1, 16, 16), torch.randint(0, 10, (256,))), batch_size=32, shuffle=True)
for images, labels in loader:
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
print(loss.item())
