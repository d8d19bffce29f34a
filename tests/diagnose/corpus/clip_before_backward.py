import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = nn.LSTM(8, 32, batch_first=True)
head = nn.Linear(32, 1)
params = list(model.parameters()) + list(head.parameters())
optimizer = torch.optim.Adam(params, lr=1e-3)
x = torch.randn(256, 20, 8)
loader = DataLoader(TensorDataset(x, x.sum(dim=(1, 2)).unsqueeze(1)), batch_size=16, shuffle=True)
for epoch in range(2):
    for seq, target in loader:
        optimizer.zero_grad()
        out, _ = model(seq)
        loss = nn.functional.mse_loss(head(out[:, -1]), target)
        torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
