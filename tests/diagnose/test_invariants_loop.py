"""Invariants of how the loop uses what the backward makes: gradients a step uses before they are
cleared, weights that move against their gradient, a loss bounded below, and weights that start at a
scale the layers can carry. Each runs real training under a probe beside its healthy twin."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchkeel.diagnose.invariants import _losses_findings, depth, descent, optimizers
from torchkeel.diagnose.probe import Probe
from torchkeel.diagnose.runner import ScriptOutcome

OK = ScriptOutcome(path="train.py", argv=[])
X, Y = torch.randn(256, 8), torch.randint(0, 3, (256,))


def probed(train) -> Probe:
    with Probe(anomaly_steps=0) as probe:
        train()
    return probe


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))


def test_a_step_outside_the_batch_loop_discards_the_gradients_of_the_other_batches():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(step_each_batch: bool) -> None:
        for _ in range(3):
            for i in range(0, 256, 32):
                opt.zero_grad()
                F.cross_entropy(model(X[i : i + 32]), Y[i : i + 32]).backward()
                if step_each_batch:
                    opt.step()
            if not step_each_batch:
                opt.step()

    found = optimizers.grads_discarded(probed(lambda: train(False)).facts, OK)
    assert [f.id for f in found] == ["invariant-grads-discarded"]
    assert found[0].evidence["discarded"] == 21 and found[0].evidence["backwards"] == 24
    assert optimizers.grads_discarded(probed(lambda: train(True)).facts, OK) == []


def manual(sign: float) -> Probe:
    model = net()

    def train() -> None:
        for _ in range(40):
            model.zero_grad()
            F.cross_entropy(model(X), Y).backward()
            for p in model.parameters():
                p.data.add_(p.grad, alpha=sign * 0.05)

    return probed(train)


def test_a_hand_written_update_that_adds_the_gradient_climbs_and_one_that_subtracts_it_descends():
    found = descent.updates_ascend(manual(+1.0).facts, OK)
    assert [f.id for f in found] == ["invariant-updates-ascend"] and found[0].evidence["median_cosine"] > 0.99
    assert descent.updates_ascend(manual(-1.0).facts, OK) == []
    # no optimizer: the gradients a hand-written update reads are not "discarded" by its zero_grad
    assert optimizers.grads_discarded(manual(-1.0).facts, OK) == []


def test_adam_with_momentum_descends_too():
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def train() -> None:
        for _ in range(40):
            opt.zero_grad()
            F.cross_entropy(model(X), Y).backward()
            opt.step()

    assert descent.updates_ascend(probed(train).facts, OK) == []


def test_a_negated_sum_of_losses_falls_without_bound_and_the_sum_itself_does_not():
    def run(sign: float) -> Probe:
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        target = torch.rand(256, 8).round()

        def train() -> None:
            for _ in range(150):
                out = model(X)
                loss = sign * (F.mse_loss(out, target, reduction="sum") + out.pow(2).sum())
                opt.zero_grad()
                loss.backward()
                opt.step()

        return probed(train)

    found = _losses_findings.loss_unbounded(run(-1.0).facts, OK)
    assert [f.id for f in found] == ["invariant-loss-unbounded"] and found[0].evidence["last"] < 0
    assert _losses_findings.loss_unbounded(run(1.0).facts, OK) == []


def test_weights_drawn_at_std_one_start_too_large_and_the_default_init_does_not():
    def run(std: float | None) -> Probe:
        model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
        if std is not None:
            for m in model:
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=std)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def train() -> None:
            for _ in range(5):
                opt.zero_grad()
                F.cross_entropy(model(X), Y).backward()
                opt.step()

        return probed(train)

    found = depth.init_scale(run(1.0).facts, OK)
    assert [f.id for f in found] == ["invariant-init-scale"] and "too large" in found[0].message
    assert found[0].evidence["num_off"] == 2  # the first layer has 8 inputs: std 1 is sqrt(8) = 2.8 times its scale
    assert "too small" in depth.init_scale(run(1e-4).facts, OK)[0].message
    assert depth.init_scale(run(None).facts, OK) == []
