import torch
import torch.nn as nn


class CharModel(nn.Module):
    def __init__(self, vocab=20, hidden=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.rnn = nn.RNN(16, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens, state):
        out, state = self.rnn(self.emb(tokens), state)
        return self.head(out), state


torch.manual_seed(0)
model = CharModel()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
text = torch.randint(0, 20, (4, 201))
hidden = torch.zeros(1, 4, 32)
for start in range(0, 200, 25):
    chunk = text[:, start:start + 26]
    logits, hidden = model(chunk[:, :-1], hidden)
    loss = nn.functional.cross_entropy(logits.reshape(-1, 20), chunk[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
print(loss.item())
