import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
NUM_CLASSES = 10
x = torch.randn(200, 16)
labels = torch.randint(1, NUM_CLASSES + 1, (200,))
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, NUM_CLASSES))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
crit = nn.CrossEntropyLoss()
for x_b, y_b in DataLoader(TensorDataset(x, labels), batch_size=25, shuffle=True):
    opt.zero_grad()
    loss = crit(model(x_b), y_b)
    loss.backward()
    opt.step()
print("trained")
