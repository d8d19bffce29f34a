import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim


class Sequence(nn.Module):
    def __init__(self):
        super(Sequence, self).__init__()
        self.lstm1 = nn.LSTMCell(1, 24)
        self.linear = nn.Linear(24, 1)

    def forward(self, input):
        outputs = []
        h_t = torch.zeros(input.size(0), 24, dtype=torch.double)
        c_t = torch.zeros(input.size(0), 24, dtype=torch.double)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            outputs += [self.linear(h_t)]
        return torch.cat(outputs, dim=1)


np.random.seed(2)
torch.manual_seed(0)
T = 20
x = np.empty((16, 40), "int64")
x[:] = np.array(range(40)) + np.random.randint(-4 * T, 4 * T, 16).reshape(16, 1)
data = np.sin(x / 1.0 / T).astype("float64")
input = torch.from_numpy(data[:, :-1])
target = torch.from_numpy(data[:, 1:])
seq = Sequence().double()
criterion = nn.MSELoss()
optimizer = optim.LBFGS(seq.parameters(), lr=0.8)
for i in range(6):

    def closure():
        out = seq(input)
        loss = criterion(out, target)
        print("loss:", loss.item())
        loss.backward()
        return loss

    optimizer.step(closure)
