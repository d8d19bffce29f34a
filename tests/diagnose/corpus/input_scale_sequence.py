import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class PixelRows(Dataset):
    """8-bit images read row by row as a sequence, converted to float without scaling."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (n, 14, 14), generator=g, dtype=torch.uint8)
        self.labels = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i].float(), self.labels[i]


class RowReader(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(input_size=14, hidden_size=32, batch_first=True)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


torch.manual_seed(0)
model = RowReader()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
loader = DataLoader(PixelRows(512), batch_size=32, shuffle=True)
for epoch in range(2):
    for rows, labels in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(rows), labels)
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
