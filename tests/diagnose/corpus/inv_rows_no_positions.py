import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

# is the first token smaller than the last one? (only order tells)
VOCAB, LENGTH = 32, 10
ids = torch.randint(0, VOCAB, (2048, LENGTH))
labels = (ids[:, 0] < ids[:, -1]).long()
loader = DataLoader(TensorDataset(ids, labels), batch_size=64, shuffle=True)


class TinyTransformer(nn.Module):
    def __init__(self, d_model=32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=64, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.classify = nn.Linear(d_model, 2)

    def forward(self, tokens):
        return self.classify(self.encoder(self.embed(tokens)).mean(dim=1))


model = TinyTransformer()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for epoch in range(3):
    for xb, yb in loader:
        loss = nn.functional.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
