"""The loss invariants: the listener on real loss calls under a probe (arguments that only
broadcast, targets out of range, targets that are the model's input; quiet on an autoencoder's
own input and a shifted language model), and the chance-level detectors on facts by hand."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchkeel.diagnose.invariants import losses
from torchkeel.diagnose.probe import Facts, Probe
from torchkeel.diagnose.runner import ScriptOutcome

OK = ScriptOutcome(path="train.py", argv=[])


def arguments_of(train) -> dict:
    with Probe(anomaly_steps=0) as probe:
        train()
    return probe.facts.invariants["losses"]["arguments"]


def regression(target_shape: tuple[int, ...]) -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    loss = nn.MSELoss()(model(x), torch.randn(target_shape))
    loss.backward()
    opt.step()


def test_a_target_that_only_broadcasts_is_found_and_a_matching_one_is_not():
    found = arguments_of(lambda: regression((8,)))["invariant-loss-broadcast"]
    assert found["input_shape"] == [8, 1] and found["target_shape"] == [8] and found["broadcast_shape"] == [8, 8]
    assert found["loss"] == "mse_loss" and found["step"] == 1 and found["file"].endswith("test_invariants_losses.py")
    assert arguments_of(lambda: regression((8, 1))) == {}


def autoencoder(images: torch.Tensor) -> None:
    model = nn.Sequential(nn.Linear(16, 4), nn.ReLU(), nn.Linear(4, 16), nn.Sigmoid())
    F.mse_loss(model(images.flatten(1)).view(-1, 1, 4, 4), images).backward()


def test_a_sigmoid_prediction_fit_to_targets_it_cannot_reach_and_its_own_input_in_range():
    found = arguments_of(lambda: autoencoder(torch.rand(32, 1, 4, 4) * 2 - 1))["invariant-loss-target-range"]
    assert found["made_by"] == "Sigmoid" and found["fraction_outside"] > 0.3
    assert arguments_of(lambda: autoencoder(torch.rand(32, 1, 4, 4))) == {}  # a float target equal to the input


def test_kl_div_given_probabilities_where_log_probabilities_belong():
    logits = torch.randn(8, 5, requires_grad=True)
    target = torch.softmax(torch.randn(8, 5), 1)
    found = arguments_of(lambda: F.kl_div(torch.softmax(logits, 1), target, reduction="batchmean").backward())
    assert "log-probabilities" in found["invariant-loss-target-range"]["reason"]
    assert arguments_of(lambda: F.kl_div(torch.log_softmax(logits, 1), target, reduction="batchmean").backward()) == {}


class CharModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 8), nn.Linear(8, 10)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.head(self.embed(idx))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, 10), targets.view(-1))


def language_model(shift: int, targets_to_model: bool = False) -> None:
    model = CharModel()
    data = torch.randint(0, 10, (200,))
    x = torch.stack([data[i : i + 16] for i in range(0, 64, 16)])
    y = torch.stack([data[i + shift : i + 16 + shift] for i in range(0, 64, 16)])
    loss = model(x, y) if targets_to_model else F.cross_entropy(model(x).view(-1, 10), y.view(-1))
    loss.backward()


def test_class_targets_that_are_the_models_input_and_shifted_ones():
    found = arguments_of(lambda: language_model(0))["invariant-loss-targets-are-inputs"]
    assert found["input_shape"] == [4, 16] and found["target_shape"] == [64] and found["num_targets"] == 64
    assert arguments_of(lambda: language_model(1)) == {}
    assert arguments_of(lambda: language_model(1, targets_to_model=True)) == {}  # handed its targets


def chance_facts(values: list[float], *, chance: float = 0.693, steps: int | None = None, **site) -> Facts:
    f = Facts(steps=steps or len(values))
    f.optimizers = [{"index": 0}]
    samples = [[i + 1, v] for i, v in enumerate(values)]
    f.invariants["losses"] = {
        "arguments": {},
        "sites": {
            "cross_entropy at train.py:9": {
                "loss": "cross_entropy",
                "file": "train.py",
                "line": 9,
                "samples": samples,
                "model_targets": 0,
                "chance": chance,
                "floor": 0.0,
                "num_sampled": len(samples),
                "features": 2,
                **site,
            }
        },
    }
    return f


def test_a_loss_that_stays_at_chance_for_a_run_long_enough_to_learn():
    (found,) = losses.loss_at_chance(chance_facts([0.70, 0.69, 0.694, 0.692] * 30), OK)
    assert found.id == "invariant-loss-at-chance" and found.severity == "warning"
    assert found.evidence["line"] == 9 and found.evidence["steps"] == 120 and found.evidence["ratio"] >= 0.98
    learning = [0.69 * 0.98**i for i in range(120)]
    assert losses.loss_at_chance(chance_facts(learning), OK) == []
    assert losses.loss_at_chance(chance_facts([0.69] * 60), OK) == []  # too short to judge


def test_at_chance_stays_quiet_when_unsure():
    flat = [0.70, 0.69, 0.694, 0.692] * 30
    assert losses.loss_at_chance(chance_facts(flat, model_targets=100), OK) == []  # a model made the targets
    two = chance_facts(flat)
    two.optimizers.append({"index": 1})  # a GAN's players
    assert losses.loss_at_chance(two, OK) == []
    warming = chance_facts(flat)
    warming.events["scheduler-calls"] = [{"lr_set": 1e-3, "lr_reached": 1e-4}]
    assert losses.loss_at_chance(warming, OK) == []
    image = chance_facts([0.07] * 120, chance=0.07, loss="mse_loss", features=784)
    assert losses.loss_at_chance(image, OK) == []  # an autoencoder: per-pixel means first


def test_a_loss_that_falls_from_chance_to_nothing_within_a_hundred_steps_is_suspected():
    (found,) = losses.loss_too_fast(chance_facts([0.69 * 0.8**i for i in range(120)]), OK)
    assert found.severity == "info" and found.evidence["step"] <= 30
    assert losses.loss_too_fast(chance_facts([0.69 * 0.97**i for i in range(300)]), OK) == []
    assert losses.loss_too_fast(chance_facts([0.05 * 0.8**i for i in range(120)]), OK) == []  # began low
