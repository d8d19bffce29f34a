import torch
import torch.nn as nn

torch.manual_seed(0)
vectors = torch.randn(100, 16)


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding.from_pretrained(vectors, freeze=True)
        self.fc = nn.Linear(16, 3)

    def forward(self, tokens):
        return self.fc(self.emb(tokens).mean(1))


model = Classifier()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(20):
    tokens, labels = torch.randint(0, 100, (8, 12)), torch.randint(0, 3, (8,))
    opt.zero_grad()
    nn.functional.cross_entropy(model(tokens), labels).backward()
    opt.step()
print("ok")
