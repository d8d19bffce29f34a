import torch
import torch.nn as nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scheduler = StepLR(optimizer, step_size=30, gamma=0.1)
x = torch.randn(2000, 20)
loader = DataLoader(TensorDataset(x, torch.randint(0, 5, (2000,))), batch_size=16, shuffle=True)
for epoch in range(2):
    model.train()
    for inputs, targets in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
    print(epoch, loss.item(), scheduler.get_last_lr())
