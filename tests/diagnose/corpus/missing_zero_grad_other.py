import torch
import torch.nn as nn

torch.manual_seed(0)
encoder = nn.Linear(12, 24)
head = nn.Linear(24, 3)
opt_enc = torch.optim.SGD(encoder.parameters(), lr=0.01)
opt_head = torch.optim.SGD(head.parameters(), lr=0.01)
x, y = torch.randn(64, 12), torch.randint(0, 3, (64,))
for step in range(12):
    opt_enc.zero_grad()
    loss = nn.functional.cross_entropy(head(torch.relu(encoder(x))), y)
    loss.backward()
    opt_enc.step()
    opt_head.step()
print(loss.item())
