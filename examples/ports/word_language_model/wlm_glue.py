"""pytorch/examples ``word_language_model``'s model, data and step for ``keel train`` (the port's only code).

The model and the corpus are the script's own (``RNNModel`` from its ``model.py``, ``Corpus``
from its ``data.py``, loaded from ``source``). ``Columns`` lays a split out as the script's
``batchify`` and ``get_batch`` do: the token stream cut into ``batch_size`` columns, each batch
the next ``bptt`` tokens of every column — sample ``chunk * batch_size + column``, so a loader in
order (``data.shuffle: false``) with that batch size gives the script's batches, one row per
column. ``step`` is the script's ``train()`` body: the hidden state comes in (``None`` at an
epoch's or a validation's start: the script's ``init_hidden``), the new one goes out, and
torchkeel detaches it (the script's ``repackage_hidden``) with ``train.carry.enabled``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from pathlib import Path
from types import ModuleType

import torch
from torch.utils.data import Dataset

import torchkeel as tk


def _module(source: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"word_language_model_{name}", Path(source) / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def corpus(source: str, data: str):
    """The script's ``Corpus`` of ``data`` (train, valid, test), read once."""
    return _module(source, "data").Corpus(data)


class Columns(Dataset):
    """A split as ``batchify(tokens, batch_size)`` then ``get_batch(source, i)`` for every ``i``."""

    def __init__(self, tokens: torch.Tensor, batch_size: int, bptt: int) -> None:
        per_column = tokens.numel() // batch_size
        self.columns = tokens[: per_column * batch_size].view(batch_size, per_column)
        self.batch_size, self.bptt = batch_size, bptt
        self.num_chunks = -(-(per_column - 1) // bptt)

    def __len__(self) -> int:
        return self.num_chunks * self.batch_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk, column = divmod(index, self.batch_size)
        start = chunk * self.bptt
        end = min(start + self.bptt, self.columns.shape[1] - 1)
        return self.columns[column, start:end], self.columns[column, start + 1 : end + 1]


def make_data(source: str, data: str, batch_size: int = 20, eval_batch_size: int = 10, bptt: int = 35):
    """(train, valid) laid out for ``train.batch_size: batch_size`` and ``val.batch_size: eval_batch_size``."""
    c = corpus(source, data)
    return Columns(c.train, batch_size, bptt), Columns(c.valid, eval_batch_size, bptt)


def make_model(source: str, data: str, rnn_type: str = "LSTM", emsize: int = 200, nhid: int = 200, nlayers: int = 2,
               dropout: float = 0.2, tied: bool = False) -> torch.nn.Module:  # fmt: skip
    ntokens = len(corpus(source, data).dictionary)
    return _module(source, "model").RNNModel(rnn_type, ntokens, emsize, nhid, nlayers, dropout, tied)


def step(model, batch, hidden):
    """One of the script's batches, rows as columns, and the hidden state it leaves. Training: the
    script's ``criterion``, a mean; evaluation: a sum over the tokens, as the script's
    ``evaluate`` weighs a short last batch by what it holds."""
    inputs, targets = (t.t() for t in batch)  # [bptt, batch]: the script's get_batch
    if hidden is None:
        hidden = model.init_hidden(inputs.shape[1])
    output, hidden = model(inputs, hidden)
    if model.training:
        return tk.StepOutput(torch.nn.functional.nll_loss(output, targets.reshape(-1)), state=hidden)
    loss_sum = torch.nn.functional.nll_loss(output, targets.reshape(-1), reduction="sum")
    return tk.StepOutput(loss_sum, count=targets.numel(), state=hidden)


def step_from_zero(model, batch):
    """The control, without ``train.carry``: every batch starts from a zero hidden state."""
    return dataclasses.replace(step(model, batch, None), state=None)
