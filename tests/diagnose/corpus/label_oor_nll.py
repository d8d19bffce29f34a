import torch
import torch.nn as nn
import torch.nn.functional as F


class Tagger(nn.Module):
    def __init__(self, vocab=50, tags=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.proj = nn.Linear(16, tags)

    def forward(self, tokens):
        return F.log_softmax(self.proj(self.emb(tokens)), dim=-1)


torch.manual_seed(0)
model = Tagger()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
tokens = torch.randint(0, 50, (40, 7))
tags = torch.randint(0, 7, (40, 7))
for step in range(5):
    out = model(tokens)
    loss = F.nll_loss(out.reshape(-1, out.shape[-1]), tags.reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
print(loss.item())
