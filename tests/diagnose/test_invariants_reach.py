"""The rows family's checks of what a model reads. Its output depends on all of its input: replacing
the later half of every input row (along time, or an image's height) with another row's must change
some output (a model that reads only the start, ``out[:, 0]`` where ``out[:, -1]`` was meant, does
not). A model that attends reads the order of its input (attention without positions does not)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from torchkeel.diagnose.invariants import rows
from torchkeel.diagnose.probe import Probe
from torchkeel.diagnose.runner import ScriptOutcome

OK = ScriptOutcome(path="train.py", argv=[])


class Reader(nn.Module):
    def __init__(self, step: int, tokens: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 4) if tokens else None
        self.lstm, self.fc, self.step = nn.LSTM(4, 16, batch_first=True), nn.Linear(16, 2), step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x) if self.embed is not None else x)
        return self.fc(out[:, self.step])


def run(model: nn.Module, x: torch.Tensor) -> Probe:
    y = torch.randint(0, 2, (x.shape[0],))
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with Probe(anomaly_steps=0) as probe:
        for _ in range(5):
            for xb, yb in loader:
                loss = F.cross_entropy(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return probe


def test_a_recurrent_model_that_reads_its_first_step_ignores_the_rest_and_one_that_reads_the_last_does_not():
    x = torch.randn(128, 12, 4)
    found = rows.input_ignored(run(Reader(0), x).facts, OK)
    assert [f.id for f in found] == ["invariant-input-ignored"]
    assert found[0].evidence["dim"] == 1 and found[0].evidence["input_shape"] == [16, 12, 4]
    assert rows.input_ignored(run(Reader(-1), x).facts, OK) == []


def test_token_ids_are_checked_too_and_padding_alike_in_every_row_is_not_judged():
    ids = torch.randint(1, 20, (128, 12))
    assert rows.input_ignored(run(Reader(0, tokens=True), ids).facts, OK)
    assert rows.input_ignored(run(Reader(-1, tokens=True), ids).facts, OK) == []
    padded = ids.clone()
    padded[:, 6:] = 0  # the later half is padding in every row: replacing it changes nothing
    probe = run(Reader(-1, tokens=True), padded)
    assert all(c["reach"] is None for c in probe.facts.invariants["rows"]["checks"])
    assert rows.input_ignored(probe.facts, OK) == []


class Attender(nn.Module):
    def __init__(self, positions: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.position = nn.Parameter(torch.randn(1, 12, 16)) if positions else None
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.fc = nn.Linear(16, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if self.position is not None:
            h = h + self.position
        return self.fc(self.encoder(h).mean(1))


def test_attention_without_positions_ignores_order_and_with_positions_reads_it():
    ids = torch.randint(0, 20, (128, 12))
    found = rows.order_ignored(run(Attender(positions=False), ids).facts, OK)
    assert [f.id for f in found] == ["invariant-order-ignored"]
    assert rows.order_ignored(run(Attender(positions=True), ids).facts, OK) == []
    assert rows.order_ignored(run(Reader(-1, tokens=True), ids).facts, OK) == []  # no attention: not checked
