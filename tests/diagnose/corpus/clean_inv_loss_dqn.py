import random

import torch
import torch.nn as nn
import torch.nn.functional as F

# A corridor of 10 cells: reach the right end for a reward of 1
N, GAMMA = 10, 0.9


def env_step(s, a):
    s = max(0, min(N - 1, s + (1 if a == 1 else -1)))
    return s, float(s == N - 1), s == N - 1


def encode(s):
    return F.one_hot(torch.tensor(s), N).float()


q_net = nn.Sequential(nn.Linear(N, 32), nn.ReLU(), nn.Linear(32, 2))
target_net = nn.Sequential(nn.Linear(N, 32), nn.ReLU(), nn.Linear(32, 2))
target_net.load_state_dict(q_net.state_dict())
optimizer = torch.optim.Adam(q_net.parameters(), lr=1e-3)
buffer, s, eps = [], 0, 1.0
for t in range(400):
    with torch.no_grad():
        a = random.randrange(2) if random.random() < eps else int(q_net(encode(s)).argmax())
    s2, r, done = env_step(s, a)
    buffer.append((s, a, r, s2, done))
    s = 0 if done else s2
    eps = max(0.1, eps * 0.99)
    if len(buffer) >= 32:
        batch = random.sample(buffer, 32)
        states = torch.stack([encode(b[0]) for b in batch])
        actions = torch.tensor([b[1] for b in batch])
        rewards = torch.tensor([b[2] for b in batch])
        next_states = torch.stack([encode(b[3]) for b in batch])
        dones = torch.tensor([float(b[4]) for b in batch])
        with torch.no_grad():
            targets = rewards + GAMMA * target_net(next_states).max(1).values * (1 - dones)
        q = q_net(states).gather(1, actions[:, None]).squeeze(1)
        loss = F.mse_loss(q, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if t % 50 == 0:
        target_net.load_state_dict(q_net.state_dict())
print(loss.item())
