"""The units family: rows of a layer that are copies of each other (a constant initialisation,
not a zero-initialised layer that trained), and ReLUs that are off for a whole batch (not a
hinge's relu in a loss), measured under the probe and judged on facts written by hand."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchkeel.diagnose.invariants.units import _copies, _unit_weights, units_dead, units_identical
from torchkeel.diagnose.probe import Facts, Probe
from torchkeel.diagnose.runner import ScriptOutcome

OK = ScriptOutcome(path="train.py", argv=[])


def test_rows_equal_to_another_row_are_copies_and_random_rows_are_not():
    layer = nn.Linear(10, 6)
    assert _copies(layer.weight)["num_copies"] == 0
    with torch.no_grad():
        layer.weight[2:5] = layer.weight[0]
    found = _copies(layer.weight)
    assert found["num_copies"] == 4 and found["num_distinct"] == 3 and found["num_units"] == 6
    conv = nn.Conv2d(3, 8, 3)
    nn.init.constant_(conv.weight, 0.1)
    assert _copies(conv.weight)["num_copies"] == 8
    assert _copies(nn.Linear(4, 1).weight) is None  # one unit


def test_the_units_of_linear_conv_and_recurrent_layers_are_the_rows_of_their_weights():
    assert [n for n, _ in _unit_weights(nn.Linear(3, 4))] == ["weight"]
    assert [n for n, _ in _unit_weights(nn.Conv1d(3, 4, 3))] == ["weight"]
    assert [n for n, _ in _unit_weights(nn.LSTM(3, 4, num_layers=2))] == [
        "weight_ih_l0",
        "weight_hh_l0",
        "weight_ih_l1",
        "weight_hh_l1",
    ]
    assert _unit_weights(nn.ConvTranspose2d(3, 8, 3)) == [] and _unit_weights(nn.Embedding(5, 3)) == []


def identical_facts(num_copies: int, num_units: int = 64, at_start: dict | None = None) -> Facts:
    f = Facts(steps=100)
    layer = {
        "module": "model.fc1",
        "module_class": "Linear",
        "param": "weight",
        "num_units": num_units,
        "num_copies": num_copies,
        "num_distinct": num_units - num_copies + 1,
        "row_norm": 0.2,
        "at_start": at_start,
        "filled_by": {"call": "constant_", "file": "train.py", "line": 16, "function": "init"},
    }
    f.invariants["units"] = {"identical": [layer], "dead": [], "steps": 100}
    return f


def test_a_layer_of_copies_is_reported_with_the_line_that_filled_it():
    (found,) = units_identical(identical_facts(64), OK)
    assert found.id == "invariant-units-identical" and found.severity == "warning"
    assert found.evidence["module"] == "model.fc1" and found.evidence["num_copies"] == 64
    assert found.evidence["filled_by"] == "constant_" and found.evidence["line"] == 16
    assert units_identical(identical_facts(2), OK) == []  # two rows alike by chance in a wide layer


def test_copies_of_a_non_zero_row_at_the_first_step_are_a_constant_init_even_once_they_part():
    (found,) = units_identical(identical_facts(0, at_start={"num_copies": 64, "row_norm": 0.4}), OK)
    assert found.evidence["num_copies_at_start"] == 64 and found.evidence["num_copies"] == 0
    assert "at the first step" in found.message
    # A zero-initialised layer (a LoRA factor, a head) starts as copies of the zero row and parts.
    assert units_identical(identical_facts(0, at_start={"num_copies": 64, "row_norm": 0.0}), OK) == []


def dead_facts(fractions: list[float]) -> Facts:
    f = Facts(steps=len(fractions))
    relu = {
        "module": "model.act",
        "module_class": "ReLU",
        "activation": "relu",
        "unit_shape": [128],
        "steps": list(range(1, len(fractions) + 1)),
        "dead_fractions": fractions,
        "num_samples": len(fractions),
        "file": "train.py",
        "line": 15,
        "function": "forward",
    }
    f.invariants["units"] = {"identical": [], "dead": [relu], "steps": len(fractions)}
    return f


def test_a_relu_off_for_the_whole_batch_at_its_last_sampled_steps_is_dead():
    (found,) = units_dead(dead_facts([0.2, 0.5, 0.95, 0.97, 0.96, 0.98]), OK)
    assert found.id == "invariant-units-dead"
    assert found.evidence["module"] == "model.act" and found.evidence["since_step"] == 3
    assert found.evidence["dead_fraction"] == 0.97 and found.evidence["line"] == 15
    assert units_dead(dead_facts([0.95, 0.97, 0.96, 0.5]), OK) == []  # it came back
    assert units_dead(dead_facts([0.0, 0.02, 0.6, 0.58, 0.59]), OK) == []  # sparse, alive
    assert units_dead(dead_facts([0.95, 0.97]), OK) == []  # too few samples


class Net(nn.Module):
    def __init__(self, bias: float | None = None, constant: bool = False):
        super().__init__()
        self.hidden, self.act, self.out = nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)
        if bias is not None:
            nn.init.constant_(self.hidden.bias, bias)
        if constant:
            self.hidden.weight.data.fill_(0.05)
            self.hidden.bias.data.zero_()
            nn.init.constant_(self.out.weight, 0.05)

    def forward(self, x):
        return self.out(self.act(self.hidden(x)))


def train(steps: int = 6, **build) -> Facts:
    """``Net(**build)`` trained for ``steps`` steps, built under the probe as a script's model is."""
    x, y = torch.randn(32, 10), torch.randint(0, 3, (32,))
    with Probe(anomaly_steps=0) as probe:
        model = Net(**build)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for _ in range(steps):
            out = model(x)
            loss = F.cross_entropy(out, y) + 0.1 * F.relu(0.5 - out.abs()).mean()  # a hinge outside the model
            opt.zero_grad()
            loss.backward()
            opt.step()
    return probe.facts


def test_the_listener_finds_copies_made_by_a_fill_before_the_first_step():
    torch.manual_seed(0)
    data = train(constant=True).invariants["units"]
    layers = {layer["module"]: layer for layer in data["identical"]}
    assert layers["model.hidden"]["num_copies"] == 32
    assert layers["model.hidden"]["filled_by"]["call"] == "fill_"
    assert layers["model.out"]["num_copies"] == 0  # the output rows get different gradients: they part
    assert layers["model.out"]["at_start"]["num_copies"] == 3 and layers["model.out"]["at_start"]["row_norm"] > 0
    assert layers["model.hidden"]["at_start"]["num_copies"] == 32


def test_the_listener_measures_relus_inside_the_model_only_at_sampled_steps():
    torch.manual_seed(0)
    data = train(steps=12, bias=-5.0).invariants["units"]
    (relu,) = data["dead"]  # the hinge's relu, outside any module, is not an activation
    assert relu["module"] == "model.act" and relu["activation"] == "relu"
    assert relu["steps"] == [1, 2, 3, 4, 5, 10] and min(relu["dead_fractions"]) >= 0.9
    torch.manual_seed(0)
    (alive,) = train(steps=6).invariants["units"]["dead"]
    assert max(alive["dead_fractions"]) < 0.5
