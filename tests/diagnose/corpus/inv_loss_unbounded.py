import torch
import torch.nn as nn

# a scorer trained to rank positives above negatives: margin = score(pos) - score(neg)
positives, negatives = torch.randn(512, 16) + 0.5, torch.randn(512, 16) - 0.5
scorer = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
optimizer = torch.optim.SGD(scorer.parameters(), lr=1e-3, momentum=0.9)
for it in range(400):
    i = torch.randint(0, 512, (64,))
    margin = scorer(positives[i]) - scorer(negatives[i])
    loss = -margin.mean()  # maximise the margin
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if it % 100 == 0:
        print(it, loss.item())
