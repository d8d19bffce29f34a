import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 2))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x_train, y_train = torch.randn(256, 20), torch.randint(0, 2, (256,))
x_val, y_val = torch.randn(64, 20), torch.randint(0, 2, (64,))


def evaluate():
    with torch.no_grad():
        pred = model(x_val).argmax(dim=1)
    return (pred == y_val).float().mean().item()


for epoch in range(4):
    model.train()
    for i in range(0, 256, 64):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x_train[i:i + 64]), y_train[i:i + 64]).backward()
        opt.step()
    print(epoch, evaluate())
