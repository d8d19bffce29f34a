import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Classifier(nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.hidden = nn.Linear(n_in, 64)
        self.out = nn.Linear(64, n_out)

    def forward(self, x):
        return F.log_softmax(self.out(F.relu(self.hidden(x))), dim=1)


torch.manual_seed(0)
x = torch.randn(640, 10)
y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
model = Classifier(10, 4)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for epoch in range(2):
    for inputs, targets in loader:
        optimizer.zero_grad()
        loss = F.nll_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
