import math

import torch
import torch.nn as nn
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, StepLR
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
x = torch.randn(2000, 20)
loader = DataLoader(TensorDataset(x, torch.randint(0, 5, (2000,))), batch_size=16, shuffle=True)
epochs = 2
# A cosine over the run, counted in steps, stepped every batch; a warmup as transformers writes it.
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
cosine = CosineAnnealingLR(optimizer, T_max=epochs * len(loader))
head_opt = torch.optim.SGD(model[2].parameters(), lr=0.05)
warmup = LambdaLR(head_opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * s / (epochs * len(loader)))))
# A StepLR counted in epochs, stepped once an epoch.
decay_opt = torch.optim.SGD(model[0].parameters(), lr=0.01)
decay = StepLR(decay_opt, step_size=1, gamma=0.5)
for epoch in range(epochs):
    for inputs, targets in loader:
        for opt in (optimizer, head_opt, decay_opt):
            opt.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        for opt in (optimizer, head_opt, decay_opt):
            opt.step()
        cosine.step()
        warmup.step()
    decay.step()
    print(epoch, loss.item(), cosine.get_last_lr(), decay.get_last_lr())
