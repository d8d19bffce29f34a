import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(12, 48), nn.ReLU(), nn.Linear(48, 6), nn.Softmax(dim=1))
criterion = nn.CrossEntropyLoss()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(240, 12)
y = x[:, :6].argmax(dim=1)
for epoch in range(6):
    for i in range(0, 240, 40):
        opt.zero_grad()
        loss = criterion(model(x[i:i + 40]), y[i:i + 40])
        loss.backward()
        opt.step()
    print(epoch, loss.item())
