"""The loss invariants added for arguments a loss accepts without complaint but cannot learn from:
raw scores into nll_loss, a softmax fit to multi-hot targets, label smoothing that leaves little of
the label, padding counted as a class, a loss under a minus sign, and a language model whose loss
falls faster than text allows. Each runs real training under a probe, beside its healthy twin."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchkeel.diagnose.invariants import _losses_findings as findings
from torchkeel.diagnose.probe import Probe
from torchkeel.diagnose.runner import ScriptOutcome

OK = ScriptOutcome(path="train.py", argv=[])


def probed(train) -> Probe:
    with Probe(anomaly_steps=0) as probe:
        train()
    return probe


def arguments(train) -> dict:
    return probed(train).facts.invariants["losses"]["arguments"]


def steps(model: nn.Module, loss_of, count: int = 6) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(count):
        loss = loss_of(model)
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_nll_loss_given_raw_scores_and_given_log_softmax():
    x, y = torch.randn(32, 6), torch.randint(0, 4, (32,))
    raw = arguments(lambda: steps(nn.Linear(6, 4), lambda m: F.nll_loss(m(x), y)))
    assert "log-probabilities" in raw["invariant-loss-target-range"]["reason"]
    assert arguments(lambda: steps(nn.Linear(6, 4), lambda m: F.nll_loss(F.log_softmax(m(x), 1), y))) == {}


def test_a_softmax_fit_to_multi_hot_targets_and_to_one_hot_ones():
    x = torch.randn(32, 6)
    multi = (torch.randn(32, 5) > 0).float()
    multi[:, 0] = multi[:, 1] = 1.0  # every row holds at least two labels
    one_hot = F.one_hot(torch.randint(0, 5, (32,)), 5).float()

    def fit(t: torch.Tensor) -> dict:
        return arguments(lambda: steps(nn.Linear(6, 5), lambda m: F.binary_cross_entropy(torch.softmax(m(x), 1), t)))

    found = fit(multi)["invariant-loss-target-range"]
    assert found["made_by"] == "Softmax" and found["fraction_outside"] == 1.0
    assert fit(one_hot) == {}


def test_label_smoothing_that_leaves_less_than_half_the_label():
    x, y = torch.randn(32, 6), torch.randint(0, 4, (32,))
    heavy = arguments(lambda: steps(nn.Linear(6, 4), lambda m: F.cross_entropy(m(x), y, label_smoothing=0.9)))
    assert heavy["invariant-loss-target-range"]["label_smoothing"] == 0.9
    assert arguments(lambda: steps(nn.Linear(6, 4), lambda m: F.cross_entropy(m(x), y, label_smoothing=0.1))) == {}


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8, padding_idx=0)
        self.out = nn.Linear(8, 20)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids))


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 20, (16, 12))
    ids[:, 7:] = 0  # right padding
    return ids, torch.roll(ids, -1, dims=1)


def test_padding_the_embedding_declares_counted_by_the_loss_and_ignored_by_it():
    ids, tags = padded_batch()

    def fit(**kw) -> Probe:
        return probed(
            lambda: steps(Tagger(), lambda m: F.cross_entropy(m(ids).reshape(-1, 20), tags.reshape(-1), **kw))
        )

    found = findings.counts_padding(fit().facts, OK)
    assert [f.id for f in found] == ["invariant-loss-counts-padding"]
    assert found[0].evidence["padding_idx"] == 0 and found[0].evidence["padding_share"] > 0.3
    assert findings.counts_padding(fit(ignore_index=0).facts, OK) == []


def test_a_loss_under_a_minus_sign_is_climbed_and_a_policy_gradient_is_not():
    x, y = torch.randn(32, 6), torch.randint(0, 4, (32,))
    climbed = probed(lambda: steps(nn.Linear(6, 4), lambda m: -F.cross_entropy(m(x), y)))
    assert [f.evidence["loss_op"] for f in findings.loss_negated(climbed.facts, OK)] == ["NllLoss"]
    advantage = torch.randn(32)

    def policy_gradient(m: nn.Module) -> torch.Tensor:
        logp = F.log_softmax(m(x), 1).gather(1, y[:, None]).squeeze(1)
        return -(logp * advantage).mean()

    assert findings.loss_negated(probed(lambda: steps(nn.Linear(6, 4), policy_gradient)).facts, OK) == []


class Peeking(nn.Module):
    """A next-token model that is handed the token it predicts (as attention without a causal mask)."""

    def __init__(self, peek: bool) -> None:
        super().__init__()
        self.embed, self.out, self.peek = nn.Embedding(30, 32), nn.Linear(64, 30), peek

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        later = torch.roll(h, -1, dims=1) if self.peek else torch.zeros_like(h)
        return self.out(torch.cat([h, later], dim=-1))


def test_a_language_model_whose_loss_falls_faster_than_text_allows_is_a_warning():
    text = torch.randint(0, 30, (8, 33))

    def run(peek: bool) -> Probe:
        model = Peeking(peek)
        opt = torch.optim.Adam(model.parameters(), lr=3e-2)

        def train() -> None:
            for _ in range(80):
                inputs, targets = text[:, :-1], text[:, 1:]
                loss = F.cross_entropy(model(inputs).reshape(-1, 30), targets.reshape(-1))
                opt.zero_grad()
                loss.backward()
                opt.step()

        return probed(train)

    found = findings.loss_too_fast(run(peek=True).facts, OK)
    assert [(f.id, f.severity) for f in found] == [("invariant-loss-too-fast", "warning")]
    assert findings.loss_too_fast(run(peek=False).facts, OK) == []


def test_binary_targets_coded_minus_one_plus_one_and_coded_zero_one():
    x = torch.randn(32, 6)
    signs = torch.randint(0, 2, (32, 1)).float() * 2 - 1
    bce = F.binary_cross_entropy_with_logits
    found = arguments(lambda: steps(nn.Linear(6, 1), lambda m: bce(m(x), signs)))["invariant-loss-target-range"]
    assert found["target_min"] == -1.0 and "[0, 1]" in found["reason"]
    assert arguments(lambda: steps(nn.Linear(6, 1), lambda m: bce(m(x), (signs + 1) / 2))) == {}


def test_ignore_index_set_to_a_real_class_of_one_label_a_sample():
    x, y = torch.randn(64, 6), torch.arange(64) % 4
    found = arguments(lambda: steps(nn.Linear(6, 4), lambda m: F.cross_entropy(m(x), y, ignore_index=0)))
    assert found["invariant-loss-target-range"]["ignore_index"] == 0
    assert found["invariant-loss-target-range"]["ignored_share"] == 0.25
    assert arguments(lambda: steps(nn.Linear(6, 4), lambda m: F.cross_entropy(m(x), y))) == {}


class SentenceClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.out = nn.Embedding(20, 8, padding_idx=0), nn.Linear(8, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids).mean(1))


def test_a_sentence_label_equal_to_the_padding_id_is_a_class_not_padding():
    ids, labels = padded_batch()[0], torch.arange(16) % 2  # class 0 is half the labels, and the padding id
    probe = probed(lambda: steps(SentenceClassifier(), lambda m: F.cross_entropy(m(ids), labels)))
    assert findings.counts_padding(probe.facts, OK) == []
