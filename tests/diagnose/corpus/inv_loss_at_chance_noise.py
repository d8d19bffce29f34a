import torch
import torch.nn as nn

# A "sensor" stream: each step reads a fresh batch of 16 readings and the event class.
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)


def read_batch(n=64):
    readings = torch.randn(n, 16)
    events = torch.randint(0, 4, (n,))  # the event log is read apart from the readings
    return readings, events


for step in range(300):
    x, y = read_batch()
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(loss.item())
