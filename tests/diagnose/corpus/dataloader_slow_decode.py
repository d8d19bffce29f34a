import json

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class Records(Dataset):
    def __init__(self, n=256):
        self.rows = [json.dumps({"id": i, "values": [((i * 31 + k) % 97) / 97 for k in range(3000)]}) for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        record = json.loads(self.rows[i])
        values = sorted(record["values"])
        x = torch.tensor(values[::100][:30], dtype=torch.float32)
        return x, torch.tensor(record["id"] % 3)


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(Records(), batch_size=16, shuffle=True)
    for epoch in range(5):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()


if __name__ == "__main__":
    main()
