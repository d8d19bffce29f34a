import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
features = torch.randn(1024, 16)
labels = (features[:, :4].sum(1) > 0).long()
loader = DataLoader(TensorDataset(features, labels), batch_size=32, shuffle=True)

model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.9**epoch)

for epoch in range(10):
    total = 0.0
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        total += loss.item()
    print(f"epoch {epoch}: loss {total / len(loader):.4f} lr {scheduler.get_last_lr()[0]:.2e}")
