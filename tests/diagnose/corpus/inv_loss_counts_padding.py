import torch
import torch.nn as nn

PAD, VOCAB = 0, 50
# sentences of 5..20 tokens, right-padded to 24; the tag of a token is its id mod 7 (+1, 0 is padding)
lengths = torch.randint(5, 21, (512,))
tokens = torch.randint(1, VOCAB, (512, 24))
tokens[torch.arange(24)[None, :] >= lengths[:, None]] = PAD
tags = torch.where(tokens == PAD, torch.zeros_like(tokens), tokens % 7 + 1)


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32, padding_idx=PAD)
        self.lstm = nn.LSTM(32, 32, batch_first=True)
        self.out = nn.Linear(32, 8)

    def forward(self, ids):
        h, _ = self.lstm(self.embed(ids))
        return self.out(h)


model = Tagger()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
criterion = nn.CrossEntropyLoss()
for epoch in range(3):
    for i in range(0, 512, 32):
        logits = model(tokens[i : i + 32])
        loss = criterion(logits.reshape(-1, 8), tags[i : i + 32].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
