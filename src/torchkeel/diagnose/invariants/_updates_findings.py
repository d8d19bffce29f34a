"""The updates family's detectors: pure functions from ``Facts`` to findings (see ``diagnose.invariants.updates``)."""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any

from torchkeel.diagnose.findings import Finding, site_fields
from torchkeel.introspect.sites import site_text

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.facts import Facts

FAMILY = "updates"
TOO_SMALL = 1e-7  # every weight tensor's ratio below this: no learning at any useful pace
SMALL = 3e-5  # ... below this, and the loss does not fall (Adam at lr 1e-7: 1e-6..1e-5; a fine-tune at 1e-5: ~1e-4)
LOSS_FALL = 0.02  # a loss that falls by less than this fraction over those steps does not fall
TOO_LARGE = 0.9  # a parameter's ratio at or above this (~1): each step replaces the weights
WEIGHT_FLOOR = 1e-6  # ||w|| below this is not judged (a zero-initialised bias or LoRA factor)
CLIP_FACTOR = 10.0  # norm / max_norm at or above this: the clip, not the lr, sets the step
CLIP_FRACTION = 0.9  # ... at this fraction of the sampled clip calls
GRAD_FLOOR = 1e-3  # ||g|| / ||w|| of the whole model below this: converging, not stuck


# ---------------------------------------------------------------- detectors (pure: Facts → findings)
def _ratios(sample: dict[str, Any]) -> dict[str, float]:
    """Parameter name → ||Δw|| / ||w|| at one sampled step, parameters above the weight floor."""
    return {
        name: delta / weight
        for name, delta, weight in zip(sample["params"], sample["deltas"], sample["weights"])
        if weight > WEIGHT_FLOOR and math.isfinite(delta) and math.isfinite(weight)
    }


def _by_optimizer(facts: Facts) -> dict[int, list[dict[str, Any]]]:
    groups: dict[int, list[dict[str, Any]]] = {}
    for sample in facts.invariants.get(FAMILY, {}).get("samples", []):
        groups.setdefault(sample["optimizer"], []).append(sample)
    return groups


def _optimizer(facts: Facts, index: int) -> dict[str, Any]:
    opts = facts.invariants.get(FAMILY, {}).get("optimizers", [])
    return opts[index] if index < len(opts) else {}


def _large_clips(facts: Facts) -> list[dict[str, Any]]:
    """The clip calls that rescale by ≥ CLIP_FACTOR at ≥ CLIP_FRACTION of their sampled calls."""
    found = []
    for record in facts.invariants.get(FAMILY, {}).get("clips", []):
        factors = [c["factor"] for c in record["calls"]]
        if len(factors) >= 5 and sum(x >= CLIP_FACTOR for x in factors) >= CLIP_FRACTION * len(factors):
            found.append(record)
    return found


def clip_always(facts: Facts, outcome: object) -> list[Finding]:
    findings = []
    lrs = sorted({lr for s in facts.invariants.get(FAMILY, {}).get("samples", [])[-1:] for lr in s["lrs"]})
    for record in _large_clips(facts):
        factors = [c["factor"] for c in record["calls"]]
        median = statistics.median(factors)
        fraction = sum(x > 1.0 for x in factors) / len(factors)
        norms = [c["norm"] for c in record["calls"]]
        setting = "max_norm" if "max_norm" in record else "clip_value"
        message = (
            f"{record['call']}{' at ' + site_text(record) if record.get('file') else ''} rescales the gradients at "
            f"{fraction:.0%} of the sampled steps, by a median factor of {median:.3g} (gradient norm "
            f"{statistics.median(norms):.3g}, {setting} {record[setting]:.3g}): the step is the clip's, the "
            f"learning rate in effect is {1 / median:.2g} x the one set"
        )
        findings.append(
            Finding(
                "invariant-clip-always",
                "warning",
                message,
                {
                    "call": record["call"],
                    setting: record[setting],
                    "median_factor": median,
                    "fraction_rescaled": fraction,
                    "threshold_factor": CLIP_FACTOR,
                    "median_norm": statistics.median(norms),
                    "calls_sampled": len(factors),
                    "steps": [record["calls"][0]["step"], record["calls"][-1]["step"]],
                    "lrs": lrs,
                    "effective_lrs": [lr / median for lr in lrs],
                    **site_fields(record),
                },
                "Clip at a norm the gradients reach only in a spike (measure their norm first; 1.0 for most "
                "models), or scale the loss so the gradients are of that size.",
            )
        )
    return findings


def update_too_large(facts: Facts, outcome: object) -> list[Finding]:
    """A weight tensor (2-D or more) whose ratio is ≥ TOO_LARGE at ≥ 3 sampled steps. Tensors that
    start at zero (a LoRA factor, a zero-initialised head: their first steps are as large as
    they are), the layers of copies (``units.symmetric_layers``: they move as one unit) and LBFGS
    (a step() is many iterations) are left out."""
    from torchkeel.diagnose.invariants.units import symmetric_layers  # units reads this module's sampling

    symmetric = {f"{layer['module']}.{layer['param']}" for layer in symmetric_layers(facts)}
    findings = []
    for index, samples in _by_optimizer(facts).items():
        if _optimizer(facts, index).get("class") == "LBFGS":
            continue
        large = _large_updates(facts, samples, symmetric)
        if large:
            findings.append(_too_large(_optimizer(facts, index), large))
    return findings


def _large_updates(
    facts: Facts, samples: list[dict[str, Any]], left_out: set[str]
) -> dict[str, list[tuple[int, float, float]]]:
    """Weight tensor → its (step, ratio, lr) at the sampled steps where the ratio was ≥ TOO_LARGE,
    for those with ≥ 3 such steps."""
    dims = facts.invariants[FAMILY]["params"]
    seen: dict[str, list[tuple[int, float, float]]] = {}
    started_at_zero: set[str] = set()
    for sample in samples:
        lr_of = dict(zip(sample["params"], sample["lrs"]))
        ratios = _ratios(sample)
        for name in sample["params"]:
            if name not in seen and name not in ratios:
                started_at_zero.add(name)
            seen.setdefault(name, [])
        for name, ratio in ratios.items():
            if dims.get(name, {}).get("dims", 0) >= 2 and name not in started_at_zero | left_out:
                seen[name].append((sample["step"], ratio, lr_of[name]))
    return {name: hits for name, series in seen.items() if len(hits := [h for h in series if h[1] >= TOO_LARGE]) >= 3}


def _too_large(opt: dict[str, Any], large: dict[str, list[tuple[int, float, float]]]) -> Finding:
    ranked = sorted(large.items(), key=lambda kv: -statistics.median(h[1] for h in kv[1]))
    top_name, top_hits = ranked[0]
    decays = [wd for wd in opt.get("weight_decays", []) if wd > 0]
    message = (
        f"{len(large)} weight tensor(s) change by about their own size per step: {top_name} by ||dw||/||w|| = "
        f"{statistics.median(h[1] for h in top_hits):.3g} (median of {len(top_hits)} sampled steps from step "
        f"{top_hits[0][0]}; healthy runs stay near 1e-3) with {opt.get('class', 'the optimizer')} at lr "
        f"{top_hits[-1][2]:.3g}" + (f", weight decay {max(decays):.3g}" if decays else "") + _where(opt)
    )
    evidence = {
        "optimizer": opt.get("class"),
        "params": [
            {"param": name, "median_ratio": statistics.median(h[1] for h in hits), "steps": [h[0] for h in hits][:8]}
            for name, hits in ranked[:8]
        ],
        "num_params": len(large),
        "lrs": sorted({h[2] for _, hits in ranked for h in hits}),
        "weight_decays": opt.get("weight_decays", []),
        "step": top_hits[0][0],
        "threshold": TOO_LARGE,
        **site_fields(opt),
    }
    return Finding(
        "invariant-update-too-large",
        "warning",
        message,
        evidence,
        "Lower the learning rate (and the weight decay, if it is above ~0.1) until each step changes the weights by "
        "about 1e-3 of their size.",
    )


def update_too_small(facts: Facts, outcome: object) -> list[Finding]:
    """Every measured weight tensor's ratio (≥ 2-D; every parameter when there are none) below
    TOO_SMALL (or below SMALL while the loss does not fall) at every sampled step of the run's latter part (≥ 3 samples, from half-way or earlier),
    while the gradients are not what is tiny (the whole model's ||g|| / ||w|| ≥ GRAD_FLOOR: a run
    that converged moves little too), or a clip rescales them by ≥ CLIP_FACTOR."""
    findings = []
    clipped = bool(_large_clips(facts))
    for index, samples in _by_optimizer(facts).items():
        dims = facts.invariants[FAMILY]["params"]
        weights = {name for s in samples for name in s["params"] if dims.get(name, {}).get("dims", 0) >= 2}
        # Weight tensors only when there are some: a bias near zero moves by a large fraction of itself.
        judged = [
            (s, r) for s in samples if (r := {n: x for n, x in _ratios(s).items() if not weights or n in weights})
        ]
        tail = _below(judged, TOO_SMALL, samples[-1]["step"])
        threshold = TOO_SMALL
        if not tail:
            tail, threshold = _below(judged, SMALL, samples[-1]["step"]), SMALL
            if not tail or not _loss_flat(facts, tail[0][0]["step"], tail[-1][0]["step"]):
                continue
        grads = [s["grad_norm"] / math.sqrt(sum(w * w for w in s["weights"]) or 1.0) for s, _ in tail]
        if statistics.median(grads) < GRAD_FLOOR and not clipped:
            continue
        findings.append(_too_small(facts, index, samples, tail, threshold, statistics.median(grads), clipped))
    return findings


def _below(
    judged: list[tuple[dict[str, Any], dict[str, float]]], threshold: float, last_step: int
) -> list[tuple[dict[str, Any], dict[str, float]]]:
    """The latest samples whose every ratio is below ``threshold``, when there are ≥ 3 of them
    and they reach back to half-way through the run or earlier; else []."""
    tail: list[tuple[dict[str, Any], dict[str, float]]] = []
    for sample, ratios in reversed(judged):
        if max(ratios.values()) >= threshold:
            break
        tail.insert(0, (sample, ratios))
    return tail if len(tail) >= 3 and tail[0][0]["step"] - 1 <= last_step / 2 else []


def _loss_flat(facts: Facts, first_step: int, last_step: int) -> bool:
    """The losses between the two steps do not fall: the median of their last third is within
    LOSS_FALL of the median of their first third (≥ 6 losses; a slow fine-tune still falls)."""
    values = [x["value"] for x in facts.losses if first_step <= x["step"] <= last_step and math.isfinite(x["value"])]
    if len(values) < 6:
        return False
    third = len(values) // 3
    start, end = statistics.median(values[:third]), statistics.median(values[-third:])
    return start - end < LOSS_FALL * max(abs(start), 1e-12)


def _too_small(
    facts: Facts,
    index: int,
    samples: list[dict[str, Any]],
    tail: list[tuple[dict[str, Any], dict[str, float]]],
    threshold: float,
    grad_to_weight: float,
    clipped: bool,
) -> Finding:
    largest: dict[str, float] = {}
    for _, ratios in tail:
        for name, ratio in ratios.items():
            largest[name] = max(largest.get(name, 0.0), ratio)
    ranked = sorted(largest.items(), key=lambda kv: -kv[1])
    opt = _optimizer(facts, index)
    first, last = tail[0][0], tail[-1][0]
    lrs = sorted(set(last["lrs"]))
    message = (
        f"the weights hardly move: every weight tensor of {opt.get('class', 'the optimizer')} changes by less than "
        f"{threshold:g} of its norm per step from step {first['step']} to {last['step']} (largest {ranked[0][0]}, "
        f"{ranked[0][1]:.2g}; healthy runs move about 1e-3)"
        + (", and the loss does not fall" if threshold > TOO_SMALL else "")
        + f", at lr {', '.join(f'{x:.3g}' for x in lrs)}"
        + ("; a clip rescales the gradients at nearly every step" if clipped else "")
        + _where(opt)
    )
    evidence = {
        "optimizer": opt.get("class"),
        "params": [{"param": name, "max_ratio": ratio} for name, ratio in ranked[:8]],
        "num_params": len(ranked),
        "lrs": lrs,
        "first_lrs": sorted(set(samples[0]["lrs"])),
        "steps": [first["step"], last["step"]],
        "step": first["step"],
        "samples": len(tail),
        "grad_to_weight": grad_to_weight,
        "clipped": clipped,
        "threshold": threshold,
        **site_fields(opt),
    }
    return Finding(
        "invariant-update-too-small",
        "warning",
        message,
        evidence,
        "Raise the learning rate (1e-4..1e-3 for Adam, 1e-2..1e-1 for SGD), check the schedule does not reach 0 "
        "early, and clip at a norm the gradients reach only in a spike.",
    )


def _where(opt: dict[str, Any]) -> str:
    return f" (its step() at {site_text(opt)})" if opt.get("file") else ""


DETECTORS = (clip_always, update_too_large, update_too_small)
_CAUSES_OF_LARGE = {
    "lr-divergence",
    "grad-exploding",
    "input-scale",
    "nonfinite-input",
    "nonfinite-forward",
    "nonfinite-grad",
    "missing-zero-grad",
    "double-step",
    "accumulation-not-averaged",
}
EXPLAINED_BY: dict[str, set[str]] = {
    "invariant-clip-always": _CAUSES_OF_LARGE,
    "invariant-update-too-large": _CAUSES_OF_LARGE,
    "invariant-update-too-small": {
        "params-not-updating",
        "grad-none",
        "frozen-parameters",
        "grad-vanishing",
        "zero-grad-before-step",
        "scheduler-cadence",
    },
}
