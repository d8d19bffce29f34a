import random

import numpy as np
import torch
import torch.nn as nn

random.seed(0)
np.random.seed(0)
torch.manual_seed(0)
corpus = ["the cat sat on the mat", "a dog ate the bone", "the bird sang a song", "cats and dogs play"]
labels = torch.tensor([0, 1, 0, 1])
vocab = {}
for word in set(" ".join(corpus).split()):
    vocab[word] = len(vocab)
ids = [torch.tensor([vocab[w] for w in s.split()]) for s in corpus]
emb = nn.EmbeddingBag(len(vocab), 8, mode="mean")
head = nn.Linear(8, 2)
opt = torch.optim.SGD(list(emb.parameters()) + list(head.parameters()), lr=0.5)
for epoch in range(10):
    for seq, label in zip(ids, labels):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(head(emb(seq.unsqueeze(0))), label.unsqueeze(0))
        loss.backward()
        opt.step()
print(loss.item())
