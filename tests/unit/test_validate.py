"""Validation: eval mode and inference mode during the pass, train mode restored, size-weighted means."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

import torchkeel as tk


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 3)
        self.dropout = nn.Dropout(0.5)
        self.seen = []

    def forward(self, x):
        self.seen.append((self.training, torch.is_inference_mode_enabled()))
        return self.dropout(self.linear(x))


def data(n=37):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def test_eval_and_inference_mode_then_train_mode_restored():
    model = Probe().train()
    loader = tk.EpochLoader(data(), 8, shuffle=False)
    first = tk.evaluate(model, loader.epoch(0), nn.functional.cross_entropy, device=torch.device("cpu"))
    second = tk.evaluate(model, loader.epoch(0), nn.functional.cross_entropy, device=torch.device("cpu"))
    assert model.training is True
    assert set(model.seen) == {(False, True)}
    assert first == second  # dropout off: identical results


def test_eval_mode_is_kept_if_it_was_eval():
    model = Probe().eval()
    tk.evaluate(model, tk.EpochLoader(data(), 8).epoch(0), nn.functional.cross_entropy, device=torch.device("cpu"))
    assert model.training is False


def test_means_are_weighted_by_batch_size():
    model = Probe()
    dataset = data(37)  # batches of 8: the last one holds 5
    metrics = tk.evaluate(
        model,
        tk.EpochLoader(dataset, 8, shuffle=False).epoch(0),
        nn.functional.cross_entropy,
        device=torch.device("cpu"),
    )
    model.eval()
    x, y = dataset.tensors
    with torch.no_grad():
        out = model(x)
    assert abs(metrics["val_loss"] - nn.functional.cross_entropy(out, y).item()) < 1e-6
    assert abs(metrics["val_accuracy"] - (out.argmax(1) == y).double().mean().item()) < 1e-12


def test_regression_targets_report_loss_only():
    dataset = TensorDataset(torch.randn(10, 6), torch.randn(10, 3))
    metrics = tk.evaluate(
        nn.Linear(6, 3), tk.EpochLoader(dataset, 4).epoch(0), nn.functional.mse_loss, device=torch.device("cpu")
    )
    assert set(metrics) == {"val_loss"}
