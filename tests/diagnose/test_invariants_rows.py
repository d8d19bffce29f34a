"""The rows family: in evaluation mode the samples of a batch are independent. Hand-written loops
under the probe: models that mix the batch's rows (an LSTM without batch_first fed (batch, seq,
feature), a view that scrambles batch and time) are found; healthy ones (seq-first fed correctly,
BatchNorm and Dropout, noise drawn in forward) are checked and stay quiet; the check leaves the
script's run exactly as it was (training flags, a stored hidden state, the generators)."""

from __future__ import annotations

import math
import random

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchkeel.diagnose.invariants.rows import rows_mixed
from torchkeel.diagnose.probe import Facts, Probe
from torchkeel.diagnose.runner import ScriptOutcome

OK = ScriptOutcome(path="train.py", argv=[])


def _windows(rows: int = 640, steps: int = 12, features: int = 3) -> DataLoader:
    """Readings of three rhythms with noise: (batch, seq, feature) batches and class labels."""
    labels = torch.randint(0, 3, (rows,))
    t = torch.arange(steps) / steps
    rhythm = torch.stack([torch.sin(2 * math.pi * f * t) for f in (1.0, 2.0, 4.0)])
    x = rhythm[labels].unsqueeze(-1).expand(-1, -1, features) + 0.3 * torch.randn(rows, steps, features)
    return DataLoader(TensorDataset(x, labels), batch_size=32, shuffle=True, drop_last=True)


def _train(model: nn.Module, loader: DataLoader, epochs: int = 2) -> Facts:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with Probe(anomaly_steps=0) as probe:
        for _ in range(epochs):
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    return probe.facts


class TimeFirstLSTM(nn.Module):
    """The fault: nn.LSTM's default layout is (seq, batch, feature); the loader gives (batch, seq, feature)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 16)
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.fc(out[:, -1])


class ViewedGRU(nn.Module):
    """The fault: ``view`` where a ``transpose`` belongs, before a seq-first GRU."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(3, 16)
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, features = x.shape
        out, _ = self.gru(x.view(steps, batch, features))
        return self.fc(out[-1])


class TwoLayouts(nn.Module):
    """Healthy: a batch_first LSTM, then a seq-first GRU fed (seq, batch, feature) by a transpose."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.LSTM(3, 16, batch_first=True)
        self.summary = nn.GRU(16, 16)
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps, _ = self.encoder(x)
        _, last = self.summary(steps.transpose(0, 1))
        return self.fc(last[-1])


class NoisyEncoder(nn.Module):
    """Healthy: a VAE-like encoder that draws its noise in forward, with BatchNorm and Dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(36, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3))
        self.mu, self.log_var = nn.Linear(32, 8), nn.Linear(32, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        mu, log_var = self.mu(h), self.log_var(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * log_var)
        return self.head(z)


def test_an_lstm_without_batch_first_fed_batch_rows_is_found():
    facts = _train(TimeFirstLSTM(), _windows())
    (found,) = rows_mixed(facts, OK)
    evidence = found.evidence
    assert found.id == "invariant-rows-mixed" and found.severity == "warning"
    assert evidence["model"] == "model" and evidence["input_shape"] == [32, 12, 3]
    assert evidence["changed_row"] == 0 and evidence["rows_changed"] >= 3 and evidence["checks_mixed"] == 3
    assert evidence["step"] == 3 and evidence["file"].endswith("test_invariants_rows.py")
    assert "batch_first=True" in found.fix


def test_a_view_that_scrambles_batch_and_time_is_found():
    (found,) = rows_mixed(_train(ViewedGRU(), _windows()), OK)
    assert found.evidence["rows_changed"] >= 3 and found.evidence["max_relative_change"] > 1e-3


def test_models_whose_samples_stay_apart_are_checked_and_quiet():
    for model in (TwoLayouts(), NoisyEncoder()):
        facts = _train(model, _windows())
        checks = facts.invariants["rows"]["checks"]
        assert len(checks) == 3 and all(c["rows_changed"] == 0 for c in checks)
        assert rows_mixed(facts, OK) == []


def test_a_seq_first_model_fed_seq_first_is_not_taken_for_a_batch():
    """(seq, batch, feature) input: dim 0 is not the loader's batch, so the GRU is not checked (the head
    on its last state is), and nothing is flagged."""
    model = nn.GRU(3, 16)
    head = nn.Linear(16, 3)
    optimizer = torch.optim.Adam([*model.parameters(), *head.parameters()], lr=1e-3)
    with Probe(anomaly_steps=0) as probe:
        for x, y in _windows():
            _, last = model(x.transpose(0, 1))
            loss = nn.functional.cross_entropy(head(last[-1]), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert [c["model"] for c in probe.facts.invariants["rows"]["checks"]] == ["head", "head"]
    assert rows_mixed(probe.facts, OK) == []


class Stateful(nn.Module):
    """A model that carries its hidden state across batches in an attribute, with a frozen norm in
    eval mode, Dropout, and noise from torch's, NumPy's and Python's generators."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(12)
        self.gru = nn.GRU(3, 16, batch_first=True)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(16, 3)
        self.hidden: torch.Tensor | None = None
        self.used: tuple = ()  # the hidden state each call started from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.used = (*self.used, self.hidden)
        noise = torch.randn_like(x) * 0.01 + float(np.random.normal()) * 1e-3 + random.random() * 1e-3
        out, hidden = self.gru(self.norm(x + noise), self.hidden)
        self.hidden = hidden.detach()
        return self.fc(self.drop(out[:, -1]))


def _stateful_run(probed: bool) -> tuple[list[float], Facts | None]:
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = Stateful()
    model.norm.eval()  # frozen statistics while the rest trains
    flags = [m.training for m in model.modules()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, probe = [], Probe(anomaly_steps=0) if probed else None
    with probe or torch.enable_grad():
        for x, y in _windows(rows=320):
            before = model.hidden
            loss = nn.functional.cross_entropy(model(x), y)
            assert model.used[-1] is before and len(model.used) == len(losses) + 1
            assert [m.training for m in model.modules()] == flags
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses, (probe.facts if probe else None)


def test_the_check_leaves_the_run_as_it_was():
    plain, _ = _stateful_run(probed=False)
    probed, facts = _stateful_run(probed=True)
    assert len(facts.invariants["rows"]["checks"]) == 2  # steps 3 and 10 of a 10-step run
    assert probed == plain  # bitwise: same dropout masks, noise, shuffles, hidden states
    assert rows_mixed(facts, OK) == []


class Graph(nn.Module):
    """Mixing on purpose: each node's output reads its neighbours (a dense adjacency or an edge list)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, links: torch.Tensor) -> torch.Tensor:
        if links.is_floating_point():
            return self.lin(links @ x)
        return self.lin(x.index_add(0, links[1], x[links[0]]))


def test_nodes_of_a_graph_that_read_their_neighbours_are_left_alone():
    nodes = torch.randn(64, 8)
    labels = (nodes[:, 0] > 0).long()
    edges = torch.randint(0, 64, (2, 256))
    adjacency = torch.zeros(64, 64).index_put_((edges[0], edges[1]), torch.tensor(1.0))
    for links in (adjacency, edges):
        model = Graph()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        with Probe(anomaly_steps=0) as probe:
            for _ in range(12):  # full-graph training: the targets have a row per node
                loss = nn.functional.cross_entropy(model(nodes, links), labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        assert probe.facts.invariants["rows"]["checks"] == []
        assert rows_mixed(probe.facts, OK) == []
