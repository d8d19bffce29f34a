import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.ln = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        return x + self.mlp(self.ln(x))


class TinyLM(nn.Module):
    def __init__(self, vocab_size=32, n_embd=32, n_layer=2):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx, targets=None):
        x = self.blocks(self.wte(idx))
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


torch.manual_seed(1337)
model = TinyLM()
optimizer = torch.optim.SGD(model.parameters(), lr=40.0, momentum=0.9)
data = torch.randint(0, 32, (2000,))
for it in range(40):
    ix = torch.randint(len(data) - 17, (8,))
    x = torch.stack([data[i : i + 16] for i in ix])
    y = torch.stack([data[i + 1 : i + 17] for i in ix])
    logits, loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if it % 5 == 0:
        print(f"iter {it}: loss {loss.item():.4f}")
