import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
gradient_accumulation_steps = 4
x = torch.randn(1024, 16)
loader = DataLoader(TensorDataset(x, torch.randint(0, 4, (1024,))), batch_size=16, shuffle=True)
for epoch in range(2):
    for micro_step, (inputs, targets) in enumerate(loader):
        loss = nn.functional.cross_entropy(model(inputs), targets) / gradient_accumulation_steps
        loss.backward()
        if (micro_step + 1) % gradient_accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    print(epoch, loss.item())
