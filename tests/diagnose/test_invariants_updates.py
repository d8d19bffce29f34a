"""The updates family: where each detector draws its line, on facts written by hand (a clip that
rescales now and then, a schedule that ends at 0, a run that converged, a zero-initialised tensor
stay quiet), and what its listener measures on a loop run under the probe."""

from __future__ import annotations

import math

import pytest
import torch

from torchkeel.diagnose.findings import Finding
from torchkeel.diagnose.invariants import judge_invariants
from torchkeel.diagnose.invariants.updates import clip_always, is_sampled, update_too_large, update_too_small
from torchkeel.diagnose.probe import Facts, Probe
from torchkeel.diagnose.runner import ScriptOutcome

OK = ScriptOutcome(path="train.py", argv=[])


def facts_with(
    ratios_per_step: dict[int, dict[str, float]],
    *,
    grad_norm: float = 1.0,
    lr: float = 0.1,
    optimizer: str = "SGD",
    clips: list | None = None,
) -> Facts:
    """Samples whose weights all have norm 1 (so each delta is its ratio), or 0 where the ratio is None."""
    names = sorted({n for ratios in ratios_per_step.values() for n in ratios})
    f = Facts(steps=max(ratios_per_step))
    f.invariants["updates"] = {
        "params": {n: {"dims": 1 if n.endswith("bias") else 2, "numel": 64} for n in names},
        "samples": [
            {
                "step": step,
                "optimizer": 0,
                "params": list(ratios),
                "deltas": [0.0 if r is None else r for r in ratios.values()],
                "weights": [0.0 if r is None else 1.0 for r in ratios.values()],
                "grad_norm": grad_norm * math.sqrt(len(ratios)),
                "lrs": [lr] * len(ratios),
            }
            for step, ratios in ratios_per_step.items()
        ],
        "optimizers": [{"class": optimizer, "weight_decays": [0.0], "file": "train.py", "line": 30}],
        "clips": clips or [],
    }
    return f


SAMPLED = [s for s in range(1, 401) if is_sampled(s)]


def test_the_sampled_steps_are_the_first_five_then_every_tenth_then_every_hundredth():
    assert [s for s in range(1, 31) if is_sampled(s)] == [1, 2, 3, 4, 5, 10, 20, 30]
    assert is_sampled(1000) and not is_sampled(1010) and is_sampled(1100)


def test_updates_that_stop_from_early_on_are_too_small_naming_the_lr_and_steps():
    ratios = {
        s: {"model.0.weight": 1e-3 if s < 100 else 3e-9, "model.0.bias": 1e-3 if s < 100 else 1e-9} for s in SAMPLED
    }
    (found,) = update_too_small(facts_with(ratios), OK)
    assert found.id == "invariant-update-too-small" and found.severity == "warning"
    assert found.evidence["steps"] == [100, 400] and found.evidence["lrs"] == [0.1]
    assert found.evidence["params"][0] == {"param": "model.0.weight", "max_ratio": 3e-9}
    assert found.evidence["line"] == 30


def test_a_schedule_that_reaches_zero_at_the_end_or_a_run_that_converged_is_not_too_small():
    end_of_cosine = {s: {"model.0.weight": 1e-3 if s < 350 else 1e-9} for s in SAMPLED}
    assert update_too_small(facts_with(end_of_cosine), OK) == []
    tiny = {s: {"model.0.weight": 1e-9} for s in SAMPLED}
    assert update_too_small(facts_with(tiny, grad_norm=1e-7), OK) == []  # the gradients are what is small
    assert update_too_small(facts_with({1: {"model.0.weight": 1e-9}, 2: {"model.0.weight": 1e-9}}), OK) == []
    assert update_too_small(facts_with(tiny), OK)  # the same updates with gradients that are not small


def test_updates_near_1e_6_are_too_small_only_while_the_loss_does_not_fall():
    f = facts_with({s: {"model.0.weight": 1e-6} for s in SAMPLED})  # Adam at lr 1e-7
    f.losses = [{"step": s, "value": 2.30 + 0.01 * (s % 3)} for s in range(1, 401)]
    (found,) = update_too_small(f, OK)
    assert found.evidence["threshold"] == 3e-5 and "does not fall" in found.message
    f.losses = [{"step": s, "value": 2.3 - 0.002 * s} for s in range(1, 401)]  # a fine-tune at a small lr learns
    assert update_too_small(f, OK) == []


def test_a_clip_that_rescales_by_a_large_factor_explains_tiny_gradients():
    tiny = {s: {"model.0.weight": 1e-9} for s in SAMPLED}
    clip = {
        "call": "clip_grad_norm_",
        "max_norm": 1e-8,
        "file": "train.py",
        "line": 28,
        "calls": [{"step": s, "norm": 2.0, "factor": 2e8} for s in SAMPLED],
    }
    (found,) = update_too_small(facts_with(tiny, grad_norm=1e-9, clips=[clip]), OK)
    assert found.evidence["clipped"] is True


def test_weights_that_change_by_their_own_size_repeatedly_are_too_large():
    ratios = {s: {"model.0.weight": 1.5, "model.0.bias": 1.5} for s in SAMPLED[:8]}
    (found,) = update_too_large(facts_with(ratios, lr=10.0), OK)
    assert found.id == "invariant-update-too-large"
    assert [p["param"] for p in found.evidence["params"]] == ["model.0.weight"]  # 1-D tensors are not judged
    assert found.evidence["lrs"] == [10.0] and found.evidence["params"][0]["steps"][:3] == [1, 2, 3]


def test_first_steps_of_a_zero_initialised_tensor_a_single_spike_and_lbfgs_are_not_too_large():
    from_zero = {1: {"lora.up.weight": None}, **{s: {"lora.up.weight": 1.0 / s} for s in SAMPLED[1:8]}}
    assert update_too_large(facts_with(from_zero), OK) == []
    spikes = {s: {"model.0.weight": 2.0 if s in (1, 2) else 1e-3} for s in SAMPLED[:10]}
    assert update_too_large(facts_with(spikes), OK) == []
    lbfgs = {s: {"model.0.weight": 1.4} for s in SAMPLED[:6]}
    assert update_too_large(facts_with(lbfgs, optimizer="LBFGS"), OK) == []


def test_a_layer_of_copies_moving_by_its_own_size_is_the_symmetry_not_the_lr():
    f = facts_with({s: {"model.0.weight": 1.5} for s in SAMPLED[:8]})
    layer = {
        "module": "model.0",
        "module_class": "Linear",
        "param": "weight",
        "num_units": 8,
        "num_copies": 8,
        "num_distinct": 1,
        "row_norm": 0.1,
        "at_start": None,
        "filled_by": None,
    }
    f.invariants["units"] = {"identical": [layer], "dead": [], "steps": f.steps}
    assert update_too_large(f, OK) == []


def clip_record(factors: list[float]) -> dict:
    return {
        "call": "clip_grad_norm_",
        "max_norm": 1.0,
        "file": "train.py",
        "line": 28,
        "calls": [{"step": s, "norm": x, "factor": x} for s, x in zip(SAMPLED, factors)],
    }


def test_a_clip_that_rescales_nearly_always_by_ten_or_more_is_reported_with_the_lr_in_effect():
    f = facts_with({1: {"w": 1e-3}}, lr=0.05, clips=[clip_record([12.0, 15.0, 11.0, 30.0, 13.0, 14.0, 20.0])])
    (found,) = clip_always(f, OK)
    assert found.id == "invariant-clip-always"
    assert found.evidence["median_factor"] == 14.0 and found.evidence["fraction_rescaled"] == 1.0
    assert found.evidence["effective_lrs"] == [pytest.approx(0.05 / 14.0)] and found.evidence["line"] == 28


def test_a_clip_that_rescales_by_a_few_times_or_only_in_spikes_is_quiet():
    healthy = [14.0, 8.1, 10.3, 5.9, 7.6, 3.7, 4.4, 5.5]  # clean_clip.py: a clip at 1.0
    assert clip_always(facts_with({1: {"w": 1e-3}}, clips=[clip_record(healthy)]), OK) == []
    assert clip_always(facts_with({1: {"w": 1e-3}}, clips=[clip_record([50.0, 40.0, 30.0, 0.5])]), OK) == []


def test_a_named_divergence_explains_updates_that_are_too_large():
    f = facts_with({s: {"model.0.weight": 3.0} for s in SAMPLED[:6]})
    named = [Finding("lr-divergence", "error", "", {}, "")]
    assert "invariant-update-too-large" in {x.id for x in judge_invariants(f, OK, [])}
    assert "invariant-update-too-large" not in {x.id for x in judge_invariants(f, OK, named)}


def test_the_listener_measures_each_sampled_step_and_the_clip_even_from_a_generator():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    expected, original = [], torch.nn.utils.clip_grad_norm_
    with Probe(anomaly_steps=0) as probe:
        for _ in range(10):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.01)
            assert float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm()) <= 0.0101
            before = model.weight.detach().clone()
            opt.step()
            expected.append(float((model.weight.detach() - before).norm() / before.norm()))
    assert torch.nn.utils.clip_grad_norm_ is original  # the wrapper is gone with the probe
    data = probe.facts.invariants["updates"]
    samples = data["samples"]
    assert [s["step"] for s in samples] == [1, 2, 3, 4, 5, 10]
    assert samples[0]["params"] == ["model.weight", "model.bias"]
    ratios = [s["deltas"][0] / s["weights"][0] for s in samples]
    assert ratios == pytest.approx([expected[i - 1] for i in (1, 2, 3, 4, 5, 10)], rel=1e-4)
    (clip,) = data["clips"]
    assert clip["call"] == "clip_grad_norm_" and clip["max_norm"] == 0.01 and len(clip["calls"]) == 6
    assert clip["calls"][-1]["factor"] == pytest.approx(float(norm) / 0.01, rel=1e-5)


def test_a_value_clip_is_measured_as_the_norm_before_over_the_norm_after():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    with Probe(anomaly_steps=0) as probe:
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            before = float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=1e-3)
            after = float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())
            assert after <= 1e-3 * 36**0.5 + 1e-9
            opt.step()
    (clip,) = probe.facts.invariants["updates"]["clips"]
    assert clip["call"] == "clip_grad_value_" and clip["clip_value"] == 1e-3
    assert clip["calls"][-1]["factor"] == pytest.approx(before / after, rel=1e-5)
