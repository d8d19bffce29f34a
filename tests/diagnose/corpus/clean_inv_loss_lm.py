import random

import torch
import torch.nn as nn

words = ["the", "a", "fox", "dog", "runs", "jumps", "over", "under", "quick", "lazy", "brown", "red", "and", "then"]
text = " ".join(random.choice(words) for _ in range(4000))
chars = sorted(set(text))
stoi = {c: i for i, c in enumerate(chars)}
data = torch.tensor([stoi[c] for c in text])
block, batch_size = 32, 16


def get_batch():
    ix = torch.randint(len(data) - block - 1, (batch_size,))
    x = torch.stack([data[i : i + block] for i in ix])
    y = torch.stack([data[i + 1 : i + block + 1] for i in ix])
    return x, y


class CharModel(nn.Module):
    def __init__(self, vocab, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        h, _ = self.rnn(self.embed(idx))
        return self.head(h)


model = CharModel(len(chars))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
for it in range(150):
    xb, yb = get_batch()
    logits = model(xb)
    loss = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), yb.view(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if it % 50 == 0:
        print(it, loss.item())
