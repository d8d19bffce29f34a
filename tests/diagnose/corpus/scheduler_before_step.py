import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[2, 4], gamma=0.1)
x = torch.randn(512, 20)
loader = DataLoader(TensorDataset(x, torch.randint(0, 5, (512,))), batch_size=32, shuffle=True)
for epoch in range(5):
    scheduler.step()
    for inputs, targets in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
    print(epoch, loss.item(), scheduler.get_last_lr())
