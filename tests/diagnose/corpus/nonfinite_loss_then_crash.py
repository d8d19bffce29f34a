import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
policy = nn.Linear(4, 2)
opt = torch.optim.SGD(policy.parameters(), lr=0.1)
for episode in range(5):
    state = torch.rand(1, 4)
    scores = policy(state)
    probs = F.softmax(torch.log(scores - 10), dim=1)
    action = torch.multinomial(probs, 1)
    loss = -torch.log(probs[0, action]).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
