import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
criterion = nn.MSELoss()
loader = DataLoader(TensorDataset(torch.randn(512, 10), torch.randn(512, 1)), batch_size=16, shuffle=True)

for batch_idx, (data, target) in enumerate(loader):
    optimizer.zero_grad()
    output = model(data)
    loss = criterion(output, target)
    loss.backward(retain_graph=True)
    if batch_idx % 10 == 0:
        print(batch_idx, loss.item())
    loss.backward()
    optimizer.step()
