import torch
import torch.nn as nn

torch.manual_seed(0)


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(8, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        h = self.hidden(x)
        return self.out(torch.log(h))


model = Regressor()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
X = torch.randn(256, 8)
y = X.sum(dim=1, keepdim=True)
for epoch in range(3):
    for i in range(0, 256, 32):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(X[i:i + 32]), y[i:i + 32])
        loss.backward()
        opt.step()
    print(f"epoch {epoch} loss {loss.item():.4f}")
