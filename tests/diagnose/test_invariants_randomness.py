"""The randomness invariants: where each detector draws its line on facts written by hand, and
the listener inside a probe around hand-written loops (a seed inside the loop, a seed per epoch
that changes, one seed per run of a sweep)."""

from __future__ import annotations

import torch
import torch.nn as nn

from torchkeel.diagnose.invariants import randomness
from torchkeel.diagnose.probe import Facts, Probe
from torchkeel.diagnose.runner import ScriptOutcome

OK = ScriptOutcome(path="train.py", argv=[])


def repeats(count: int, evaluating: bool = False) -> Facts:
    f = Facts()
    seed = {"function": "torch.manual_seed", "value": 0, "file": "train.py", "line": 7}
    rec = {"generator": "torch", "repeats": count, "steps": [[1, 2]], "first_step": 1, "seed": seed}
    f.invariants["randomness"] = {"repeats": [dict(rec, evaluating=evaluating)], "reseeds": [], "steps": 10}
    return f


def test_a_state_seen_again_twice_is_a_reset_and_one_made_while_evaluating_only_a_suspicion():
    (found,) = randomness.rng_reset(repeats(2), OK)
    assert found.severity == "warning"
    assert found.evidence["generator"] == "torch" and found.evidence["line"] == 7 and found.evidence["period"] == 1
    assert randomness.rng_reset(repeats(1), OK) == []
    assert [x.severity for x in randomness.rng_reset(repeats(5, evaluating=True), OK)] == ["info"]


def test_a_generator_made_with_one_constant_seed_at_least_every_other_step_is_reported():
    def facts(calls: int, values: list, steps: int = 20) -> Facts:
        f = Facts()
        rec = {
            "function": "numpy.random.default_rng",
            "training_calls": calls,
            "values": values,
            "file": "d.py",
            "line": 3,
        }
        f.invariants["randomness"] = {"repeats": [], "reseeds": [rec], "steps": steps}
        return f

    (found,) = randomness.rng_recreated(facts(640, [0]), OK)
    assert found.evidence["value"] == 0 and found.evidence["line"] == 3
    assert randomness.rng_recreated(facts(640, [0, 1, 2]), OK) == []  # a seed per sample
    assert randomness.rng_recreated(facts(15, [0]), OK) == []  # too few
    assert randomness.rng_recreated(facts(40, [0], steps=100), OK) == []  # once per evaluation, not per step


def train(seed_each_step: bool, seed_per_epoch: bool = False, runs: int = 1) -> dict:
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    with Probe() as probe:
        for _ in range(runs):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 1))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            for epoch in range(2):
                if seed_per_epoch:
                    torch.manual_seed(epoch)
                for i in range(0, 64, 8):
                    if seed_each_step:
                        torch.manual_seed(0)
                    optimizer.zero_grad()
                    nn.functional.mse_loss(model(x[i : i + 8]), y[i : i + 8]).backward()
                    optimizer.step()
    return probe.facts.invariants["randomness"]


def test_the_listener_sees_a_seed_inside_the_loop_and_not_a_changing_seed_or_a_sweep():
    (rec,) = train(seed_each_step=True)["repeats"]
    assert rec["generator"] == "torch" and rec["repeats"] >= 10 and rec["seed"]["function"] == "torch.manual_seed"
    assert train(seed_each_step=False, seed_per_epoch=True)["repeats"] == []
    assert train(seed_each_step=False, runs=2)["repeats"] == []


def test_a_generator_made_per_sample_counts_while_training_and_not_while_evaluating():
    import numpy as np

    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with Probe() as probe:
        for _ in range(20):
            crops = [np.random.default_rng(0).integers(0, 8) for _ in range(4)]
            with torch.no_grad():
                fixed = [np.random.default_rng(1).integers(0, 8) for _ in range(4)]
            optimizer.zero_grad()
            model(torch.randn(4, 4) + float(sum(crops) + sum(fixed))).sum().backward()
            optimizer.step()
    by_value = {r["values"][0]: r for r in probe.facts.invariants["randomness"]["reseeds"]}
    assert by_value[0]["training_calls"] >= 76 and by_value[1]["training_calls"] == 0
    (found,) = randomness.rng_recreated(probe.facts, OK)
    assert found.evidence["value"] == 0 and found.evidence["function"] == "numpy.random.default_rng"
