"""The batches family: a loop that fetches new batches while the model trains on the same rows, and
inputs too close to zero for the first layer; under the probe on hand-written loops, and where each
detector draws its line."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchkeel.diagnose.invariants.batches import batch_repeats, inputs_tiny
from torchkeel.diagnose.probe import Facts, Probe
from torchkeel.diagnose.runner import ScriptOutcome

OK = ScriptOutcome(path="train.py", argv=[])


def _train(model: nn.Module, loader: DataLoader, pick, epochs: int = 1) -> Facts:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with Probe(anomaly_steps=0) as probe:
        for _ in range(epochs):
            for x, y in loader:
                x, y = pick(x, y)
                loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    return probe.facts


def _loader(scale: float = 1.0, rows: int = 640) -> DataLoader:
    x = torch.randn(rows, 8) * scale
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=32, shuffle=True)


def test_a_batch_kept_from_before_the_loop_is_found_and_the_loaders_batches_are_not():
    loader = _loader()
    kept = next(iter(loader))
    stale = _train(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), loader, lambda x, y: kept)
    (found,) = batch_repeats(stale, OK)
    assert found.id == "invariant-batch-repeats" and found.severity == "warning"
    assert found.evidence["rows"] == 32 and found.evidence["fetches_stale"] == found.evidence["fetches_compared"] >= 5
    healthy = _train(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), loader, lambda x, y: (x, y))
    assert batch_repeats(healthy, OK) == []


def test_a_dataset_of_one_batch_read_again_is_not_a_repeat():
    one = _loader(rows=32)
    facts = _train(nn.Sequential(nn.Linear(8, 2)), one, lambda x, y: (x * 2, y), epochs=12)
    assert batch_repeats(facts, OK) == []


def test_inputs_near_zero_are_found_unless_a_norm_comes_first():
    tiny = _loader(scale=1e-3)
    facts = _train(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)), tiny, lambda x, y: (x, y))
    (found,) = inputs_tiny(facts, OK)
    assert found.evidence["max_abs"] < 1e-2 and found.evidence["module"] == "model"
    normed = _train(nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 2)), tiny, lambda x, y: (x, y))
    assert inputs_tiny(normed, OK) == []
    assert inputs_tiny(_train(nn.Sequential(nn.Linear(8, 2)), _loader(), lambda x, y: (x, y)), OK) == []


def test_a_label_column_among_the_features_is_found_and_the_columns_before_it_are_not():
    from torchkeel.diagnose.invariants.batches import targets_in_inputs

    rows = torch.randn(640, 4)
    labels = (rows[:, 0] > 0).long()
    table = torch.cat([rows, labels.unsqueeze(1).float()], dim=1)
    model = nn.Sequential(nn.Linear(5, 2))
    leaked = DataLoader(TensorDataset(table, labels), batch_size=32, shuffle=True)
    (found,) = targets_in_inputs(_train(model, leaked, lambda x, y: (x, y)), OK)
    assert found.evidence["column"] == 4 and found.evidence["batches_leaked"] == found.evidence["batches_checked"]
    clean = DataLoader(TensorDataset(table[:, :4], labels), batch_size=32, shuffle=True)
    assert targets_in_inputs(_train(nn.Sequential(nn.Linear(4, 2)), clean, lambda x, y: (x, y)), OK) == []


def test_parameters_with_gradients_that_no_optimizer_holds_and_weights_that_collapse():
    from torchkeel.diagnose.invariants.optimizers import grads_not_stepped, weights_collapse

    def run(model: nn.Module, optimizer: torch.optim.Optimizer) -> Facts:
        loader = _loader()
        with Probe(anomaly_steps=0) as probe:
            for _ in range(3):
                for x, y in loader:
                    loss = nn.functional.cross_entropy(model(x), y)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
        return probe.facts

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    (found,) = grads_not_stepped(run(model, torch.optim.SGD(model[2].parameters(), lr=0.05)), OK)
    assert found.evidence["parameters"] == ["model.0.bias", "model.0.weight"]
    whole = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    assert grads_not_stepped(run(whole, torch.optim.SGD(whole.parameters(), lr=0.05)), OK) == []
    decayed = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    facts = run(decayed, torch.optim.SGD(decayed.parameters(), lr=0.1, momentum=0.9, weight_decay=1.0))
    (collapse,) = weights_collapse(facts, OK)
    assert (
        collapse.evidence["weight_decay"] == [1.0]
        and collapse.evidence["last_norm"] < 0.05 * collapse.evidence["first_norm"]
    )
    kept = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    assert weights_collapse(run(kept, torch.optim.SGD(kept.parameters(), lr=0.1, weight_decay=5e-4)), OK) == []
