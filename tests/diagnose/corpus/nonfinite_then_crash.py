import torch
import torch.nn as nn
import torch.nn.functional as F


class Policy(nn.Module):
    def __init__(self):
        super(Policy, self).__init__()
        self.affine1 = nn.Linear(4, 64)
        self.affine2 = nn.Linear(64, 2)

    def forward(self, x):
        x = self.affine1(x)
        scores = self.affine2(torch.sqrt(x))
        return F.softmax(scores, dim=1)


torch.manual_seed(543)
policy = Policy()
optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
for episode in range(20):
    state = torch.rand(1, 4) * 0.1
    log_probs, rewards = [], []
    for t in range(10):
        probs = policy(state)
        action = torch.multinomial(probs, 1)
        log_probs.append(torch.log(probs[0, action]))
        rewards.append(1.0)
        state = state + 0.01 * torch.randn(1, 4)
    loss = -torch.cat(log_probs).sum() * (sum(rewards) / len(rewards))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
