import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(1337)
data = torch.randint(0, 64, (20000,))
block_size, batch_size, gradient_accumulation_steps = 16, 8, 4


def get_batch():
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.head = nn.Linear(32, 64)

    def forward(self, idx, targets):
        logits = self.head(self.emb(idx))
        return logits, F.cross_entropy(logits.view(-1, 64), targets.view(-1))


model = TinyLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
X, Y = get_batch()
for iter_num in range(30):
    for micro_step in range(gradient_accumulation_steps):
        logits, loss = model(X, Y)
        X, Y = get_batch()
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(loss.item())
