import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class Reviews(Dataset):
    def __init__(self, n, vocab=500, length=24):
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(1, vocab, (n, length), generator=g)
        self.stars = torch.randint(1, 6, (n,), generator=g)
        self.positive = (self.stars > 5).long()

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i], self.positive[i]


class BagOfWords(nn.Module):
    def __init__(self, vocab=500, dim=32):
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab, dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, tokens):
        return self.head(self.embed(tokens))


loader = DataLoader(Reviews(1000), batch_size=32, shuffle=True)
model = BagOfWords()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for epoch in range(2):
    for tokens, target in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(tokens), target)
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
