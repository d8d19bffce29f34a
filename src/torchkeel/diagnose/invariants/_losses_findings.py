"""The losses family's detectors: pure functions from ``Facts`` to findings (see ``diagnose.invariants.losses``)."""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any

from torchkeel.diagnose.findings import Finding, site_fields

if TYPE_CHECKING:
    pass

FAMILY = "losses"


# ---------------------------------------------------------------- detectors
_LEARN_STEPS = 100  # a run this long has had time to leave chance level (the healthy corpus: by 64 steps)
_WARMUP = 0.1  # the first tenth of the run (at least 10 steps) is not judged
_AT_CHANCE = 0.98  # the median loss of the run's second half, as a fraction of chance, at or above this
_FAST = 0.01  # a loss under 1 % of chance ...
_FAST_STEPS = 100  # ... within this many steps, from a start near chance (healthy corpus: 210 at the soonest)
_MAX_FEATURES = 16  # MSE targets with more features a row (an image to reconstruct) are not judged at chance:
# a healthy autoencoder sits at the per-pixel variance for its first hundreds of steps
_MIN_CHANCE = 0.05  # nats (classes) or a fraction of the targets' spread too small to judge


def _arguments(facts: Any) -> dict[str, dict[str, Any]]:
    return (facts.invariants.get(FAMILY) or {}).get("arguments") or {}


def _sites(facts: Any) -> list[dict[str, Any]]:
    """The loss call sites with a known chance level whose targets are data, not a model's output."""
    sites = (facts.invariants.get(FAMILY) or {}).get("sites") or {}
    usable = []
    for site in sites.values():
        chance, floor = site.get("chance"), site.get("floor", 0.0)
        if chance is None or chance - floor < (_MIN_CHANCE if site["loss"] != "mse_loss" else 1e-12):
            continue
        if site["model_targets"] * 2 > site["num_sampled"]:
            continue  # targets made by a model (RL's bootstrapped values, a teacher): no fixed chance level
        usable.append(site)
    return usable


def _ratio(value: float, site: dict[str, Any]) -> float:
    return (value - site["floor"]) / (site["chance"] - site["floor"])


def _losses_at(samples: list[list[float]], count: int = 6) -> list[dict[str, float]]:
    picks = sorted({round(i * (len(samples) - 1) / (count - 1)) for i in range(count)})
    return [{"step": int(samples[i][0]), "loss": round(samples[i][1], 6)} for i in picks]


def targets_are_inputs(facts: Any, outcome: Any) -> list[Finding]:
    ev = _arguments(facts).get("invariant-loss-targets-are-inputs")
    if ev is None:
        return []
    return [
        Finding(
            "invariant-loss-targets-are-inputs",
            "warning",
            f"the class targets of {ev['loss']} at step {ev['step']} are the model's own integer input, element for "
            f"element ({ev['num_targets']} targets, input {ev['input_shape']}): the model is asked to return what it was "
            "given",
            {**ev},
            "Shift the targets by one position for next-token prediction (inputs x[:, :-1], targets x[:, 1:]), or pass "
            "the labels the batch carries, not its inputs.",
        )
    ]


def loss_broadcast(facts: Any, outcome: Any) -> list[Finding]:
    ev = _arguments(facts).get("invariant-loss-broadcast")
    if ev is None:
        return []
    return [
        Finding(
            "invariant-loss-broadcast",
            "warning",
            f"{ev['loss']} at step {ev['step']} compares input {ev['input_shape']} with target {ev['target_shape']}: they "
            f"agree only by broadcasting, into {ev['broadcast_shape']} (every prediction against every target)",
            {**ev},
            "Give input and target the same shape (squeeze the prediction's trailing 1, output.squeeze(-1), or "
            "target.view_as(output)).",
        )
    ]


def loss_target_range(facts: Any, outcome: Any) -> list[Finding]:
    ev = _arguments(facts).get("invariant-loss-target-range")
    if ev is None:
        return []
    return [
        Finding(
            "invariant-loss-target-range",
            "warning",
            f"{ev['loss']} at step {ev['step']}: {ev['reason']} (targets from {ev['target_min']:.4g} to "
            f"{ev['target_max']:.4g})",
            {**ev},
            "Bring the targets into the range the loss expects (probabilities for cross entropy, log_softmax input "
            "for kl_div); give cross entropy raw logits (no sigmoid/tanh before it); drop an output activation "
            "(ReLU, sigmoid, tanh) whose range leaves out the targets.",
        )
    ]


def counts_padding(facts: Any, outcome: Any) -> list[Finding]:
    ev = _arguments(facts).get("invariant-loss-counts-padding")
    if ev is None:
        return []
    return [
        Finding(
            "invariant-loss-counts-padding",
            "warning",
            f"{ev['padding_share']:.0%} of the class targets of "
            f"{ev['loss']} at step {ev['step']} are the padding id {ev['padding_idx']} the model's embedding declares, "
            f"and the loss counts them (ignore_index={ev['ignore_index']}): the model learns to predict padding",
            {**ev},
            f"Pass ignore_index={ev['padding_idx']} to the loss (or mark padded targets -100), so that padding carries "
            "no loss.",
        )
    ]


def loss_negated(facts: Any, outcome: Any) -> list[Finding]:
    ev = _arguments(facts).get("invariant-loss-negated")
    if ev is None or len(facts.optimizers) > 1:
        return []  # several optimizers: one may climb another's loss on purpose (a GAN's generator)
    return [
        Finding(
            "invariant-loss-negated",
            "warning",
            f"the backward at step {ev['step']} starts from a loss under a minus sign (-{ev['loss_op']}): the "
            "optimizer climbs the loss instead of descending it",
            {**ev},
            "Call backward() on the loss itself (loss = criterion(output, target)), not on its negative.",
        )
    ]


_UNBOUNDED = 1e3  # a loss that ends below zero at this many times its first magnitude


def loss_unbounded(facts: Any, outcome: Any) -> list[Finding]:
    """The loss falls below zero without bound: nothing bounds it from below (a sign flipped on a sum
    of losses, a likelihood maximised where its negative was meant, raw scores into nll_loss)."""
    values = [x for x in facts.losses if math.isfinite(x["value"])]
    if len(values) < 10 or len(facts.optimizers) > 1:
        return []  # several optimizers: one player's loss may fall without bound against another's
    first = statistics.median(abs(x["value"]) for x in values[:5])
    third = len(values) // 3
    early, late = (
        statistics.median(x["value"] for x in values[:third]),
        statistics.median(x["value"] for x in values[-third:]),
    )
    last = values[-1]
    if last["value"] >= 0 or abs(last["value"]) < _UNBOUNDED * max(first, 1e-3) or late >= early:
        return []
    return [
        Finding(
            "invariant-loss-unbounded",
            "warning",
            f"the loss falls below zero without bound: from {values[0]['value']:.4g} at step {values[0]['step']} to "
            f"{last['value']:.4g} at step {last['step']}; no loss a model can reach is that low (a sign flipped on "
            "the loss, a likelihood maximised where its negative belongs)",
            {
                "first": values[0]["value"],
                "last": last["value"],
                "step": last["step"],
                "early_median": early,
                "late_median": late,
                "threshold": _UNBOUNDED,
            },
            "Minimise the negative log-likelihood (loss = criterion(...) or -log_likelihood), not its negative; "
            "check every sign in the loss's sum.",
        )
    ]


def loss_too_fast(facts: Any, outcome: Any) -> list[Finding]:
    found = []
    for site in _sites(facts):
        samples = site["samples"]
        if len(samples) < 4 or _ratio(samples[0][1], site) < 0.5:
            continue  # it did not start near chance (a loaded model): nothing fell
        for i in range(len(samples) - 2):
            window = sorted(v for _, v in samples[i : i + 3])
            if _ratio(window[1], site) < _FAST:
                step = int(samples[i + 2][0])
                if step <= _FAST_STEPS:
                    found.append(_too_fast(site, step))
                break
    return found[:1]


def _too_fast(site: dict[str, Any], step: int) -> Finding:
    return Finding(
        "invariant-loss-too-fast",
        # Easy data falls as fast (a CNN on clean digit templates: 1 % of chance by step 35); next-token
        # prediction does not: text is never that predictable, unless the model sees the token it predicts.
        "warning" if site.get("lm") else "info",
        f"{site['loss']} fell from chance level ({site['chance']:.4g}) to under {_FAST:.0%} of it by step {step}: "
        "faster than a model learns from its inputs; the targets may be in the inputs (a leaked label, attention "
        "that sees the future)",
        {
            "loss": site["loss"],
            "chance": round(site["chance"], 6),
            "floor": round(site["floor"], 6),
            "step": step,
            "losses": _losses_at([s for s in site["samples"] if s[0] <= 2 * step] or site["samples"]),
            "threshold": _FAST,
            "within_steps": _FAST_STEPS,
            **site_fields(site),
        },
        "Check that the inputs do not carry the targets (a label column left in the features, targets equal to "
        "inputs) and that attention is causal (a mask, or is_causal=True) when predicting the next token.",
    )


def _warming_up(facts: Any) -> bool:
    """A scheduler left the learning rate under half the one set: a warm-up still under way, or a run
    whose rate decayed early (its loss need not have left chance yet)."""
    return any(
        s.get("lr_reached", 1.0) < 0.5 * (s.get("lr_set") or 0.0) for s in facts.events.get("scheduler-calls", [])
    )


def loss_at_chance(facts: Any, outcome: Any) -> list[Finding]:
    if facts.steps < _LEARN_STEPS or len(facts.optimizers) > 1 or _warming_up(facts):
        return []  # too short to judge; several optimizers: losses against each other (GANs, actor-critic)
    warmup = max(10, _WARMUP * facts.steps)
    for site in _sites(facts):
        if site["loss"] == "mse_loss" and site.get("features", 0) > _MAX_FEATURES:
            continue  # a reconstruction: the per-feature means come first, structure slowly after
        after = [v for s, v in site["samples"] if s > warmup]
        if len(after) < 8:
            continue
        late = sorted(after[len(after) // 2 :])
        median = late[len(late) // 2]
        if _ratio(median, site) >= _AT_CHANCE:
            return [
                Finding(
                    "invariant-loss-at-chance",
                    "warning",
                    f"after {facts.steps} steps, {site['loss']} is still at chance level: the median of its second half "
                    f"is {median:.4g}, what a constant prediction scores is {site['chance']:.4g}; the model learns "
                    "nothing from its inputs",
                    {
                        "loss": site["loss"],
                        "chance": round(site["chance"], 6),
                        "floor": round(site["floor"], 6),
                        "median_late": round(median, 6),
                        "ratio": round(_ratio(median, site), 4),
                        "threshold": _AT_CHANCE,
                        "steps": facts.steps,
                        "losses": _losses_at(site["samples"]),
                        **site_fields(site),
                    },
                    "Check that the inputs reach the model and carry the labels (inputs and targets paired, not "
                    "shuffled apart), that the parameters the loss depends on are updated, and the learning rate.",
                )
            ]
    return []


IDS: tuple[str, ...] = (
    "invariant-loss-targets-are-inputs",
    "invariant-loss-counts-padding",
    "invariant-loss-negated",
    "invariant-loss-unbounded",
    "invariant-loss-broadcast",
    "invariant-loss-target-range",
    "invariant-loss-too-fast",
    "invariant-loss-at-chance",
)
DETECTORS: tuple = (
    targets_are_inputs,
    counts_padding,
    loss_negated,
    loss_unbounded,
    loss_broadcast,
    loss_target_range,
    loss_too_fast,
    loss_at_chance,
)
EXPLAINED_BY: dict[str, set[str]] = {
    "invariant-loss-target-range": {"label-out-of-range", "probabilities-into-cross-entropy"},
    "invariant-loss-unbounded": {"nonfinite-forward", "nonfinite-grad", "lr-divergence"},
    "invariant-loss-at-chance": {
        "nonfinite-input",
        "label-out-of-range",
        "unshuffled-ordered-labels",
        "zero-grad-before-step",
        "clip-before-backward",
        "missing-zero-grad",
        "params-not-updating",
        "frozen-parameters",
        "grad-none",
        "input-scale",
        "lr-divergence",
        "grad-exploding",
        "nonfinite-forward",
        "nonfinite-grad",
        "grad-vanishing",
        "softmax-over-batch",
        "probabilities-into-cross-entropy",
        "train-mode-not-restored",
        "dropout-always-on",
        "double-step",
        "repeated-backward",
        "inplace-modified",
        "accumulation-not-averaged",
    },
}
