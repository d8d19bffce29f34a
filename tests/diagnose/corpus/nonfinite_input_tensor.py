import torch
import torch.nn as nn

torch.manual_seed(0)
raw = torch.randn(300, 6) * 5 + 2
raw[:, 3] = 1.0
features = (raw - raw.mean(dim=0)) / raw.std(dim=0)
labels = (raw[:, 0] > 2).long()

model = nn.Sequential(nn.Linear(6, 24), nn.ReLU(), nn.Linear(24, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
for step in range(20):
    idx = torch.randint(0, 300, (32,))
    logits = model(features[idx])
    loss = nn.functional.cross_entropy(logits, labels[idx])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("loss", loss.item())
