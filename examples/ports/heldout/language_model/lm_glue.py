"""Glue for yunjey/pytorch-tutorial's language_model (main.py, data_utils.py) on `keel train`."""

import ast
import os
import sys

import torch
import torch.nn.functional as F

from torchkeel import StepOutput


def _corpus(source: str, train: str, batch_size: int):
    sys.path.insert(0, source)
    from data_utils import Corpus  # the script's own

    corpus = Corpus()
    return corpus, corpus.get_data(train, batch_size)


def rnnlm(source: str, train: str, embed_size: int, hidden_size: int, num_layers: int) -> torch.nn.Module:
    """The script's RNNLM. main.py trains at import, so only its class is taken out of it."""
    tree = ast.parse(open(os.path.join(source, "main.py")).read())
    cls = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RNNLM"]
    scope = {"nn": torch.nn}
    exec(compile(ast.Module(body=cls, type_ignores=[]), "main.py", "exec"), scope)
    corpus, _ = _corpus(source, train, 1)
    return scope["RNNLM"](len(corpus.dictionary), embed_size, hidden_size, num_layers)


class Chunks(torch.utils.data.Dataset):
    """ids [rows, L] read as the script reads it: chunk k is ids[:, 30k : 30k+30] and its shift
    by one, for 30k < L - 30; sample k * rows + r is row r of chunk k (a loader in order, batch
    `rows`, gives the script's batches)."""

    def __init__(self, ids: torch.Tensor, seq_length: int):
        self.ids, self.t = ids, seq_length
        self.chunks = len(range(0, ids.size(1) - seq_length, seq_length))

    def __len__(self) -> int:
        return self.chunks * self.ids.size(0)

    def __getitem__(self, i: int):
        k, r = divmod(i, self.ids.size(0))
        row = self.ids[r, k * self.t : k * self.t + self.t + 1]
        return row[:-1], row[1:]


def splits(source: str, train: str, valid: str, batch_size: int, seq_length: int):
    corpus, ids = _corpus(source, train, batch_size)
    w2i = corpus.dictionary.word2idx  # every word of `valid` must be in the training vocabulary
    toks = [w2i[w] for line in open(valid) for w in line.split() + ["<eos>"]]
    val = torch.tensor(toks[: len(toks) // batch_size * batch_size]).view(batch_size, -1)
    return Chunks(ids, seq_length), Chunks(val, seq_length)


def step(model, batch, state):
    x, y = batch
    if state is None:  # the script's zeros at each epoch
        lstm = model.lstm
        zeros = torch.zeros(lstm.num_layers, x.size(0), lstm.hidden_size, device=x.device)
        state = (zeros, zeros.clone())
    out, state = model(x, state)
    return StepOutput(F.cross_entropy(out, y.reshape(-1)), state=state)
