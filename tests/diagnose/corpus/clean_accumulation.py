import torch
import torch.nn as nn

ACCUM = 4


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(32)]
    opt.zero_grad()
    for i, (x, y) in enumerate(data):
        loss = nn.functional.mse_loss(model(x), y) / ACCUM
        loss.backward()
        if (i + 1) % ACCUM == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    print("done")


if __name__ == "__main__":
    main()
