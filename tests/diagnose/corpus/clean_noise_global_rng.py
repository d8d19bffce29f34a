import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class NoisySignals(Dataset):
    """Signals with noise added on the fly, drawn from the dataset's own generator."""

    def __init__(self, n, noise=0.1):

        self.clean = np.sin(np.linspace(0, 20, n * 64)).reshape(n, 64).astype(np.float32)
        self.noise = noise

    def __len__(self):
        return len(self.clean)

    def __getitem__(self, i):
        x = self.clean[i] + self.noise * np.random.standard_normal(64).astype(np.float32)
        return torch.from_numpy(x), torch.from_numpy(self.clean[i])


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(NoisySignals(512), batch_size=32, shuffle=True, num_workers=2)
    for epoch in range(2):
        for noisy, clean in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(noisy), clean)
            loss.backward()
            optimizer.step()
        print(epoch, loss.item())


if __name__ == "__main__":
    main()
