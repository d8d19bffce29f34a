import torch
import torch.nn as nn


class RNNModel(nn.Module):
    def __init__(self, ntoken=50, ninp=16, nhid=32, nlayers=2):
        super(RNNModel, self).__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers = nhid, nlayers

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.encoder(input), hidden)
        return self.decoder(output), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


def get_batch(source, i, bptt=10):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].reshape(-1)


torch.manual_seed(1111)
train_data = torch.randint(0, 50, (400, 4))
model = RNNModel()
criterion = nn.NLLLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
hidden = model.init_hidden(4)
for batch, i in enumerate(range(0, train_data.size(0) - 1, 10)):
    data, targets = get_batch(train_data, i)
    model.zero_grad()
    output, hidden = model(data, hidden)
    loss = criterion(torch.log_softmax(output, -1).view(-1, 50), targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    optimizer.step()
