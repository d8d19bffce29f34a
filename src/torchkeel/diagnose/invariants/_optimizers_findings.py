"""The optimizers family's detectors: pure functions from ``Facts`` to findings (see
``diagnose.invariants.optimizers``)."""

from __future__ import annotations

from typing import Any

from torchkeel.diagnose.findings import Finding

FAMILY = "optimizers"
_MIN_SAMPLES = 3
_COLLAPSE = 0.05  # a weight tensor's norm under this fraction of its first: collapsed
_COLLAPSED_SHARE = 0.5  # ... for at least this share of the weight tensors
_DOMINATES = 1.0  # the decay's pull over the loss's gradient, median of the first sampled steps
_DOMINATED_SHARE = 1.0  # ... for every decayed weight tensor: even the one the loss pushes hardest (a block
# behind a zero-initialised BatchNorm gets almost no gradient at first, however small the decay)
_RECREATED = 5  # optimizer objects made over the same parameters ...
_FEW_STEPS = 2  # ... each stepping this many times or fewer (the median): its state never builds up


def grads_not_stepped(facts: Any, outcome: object) -> list[Finding]:
    rec = facts.invariants.get(FAMILY, {})
    names = sorted(rec.get("unstepped", {}))
    if rec.get("sampled", 0) < _MIN_SAMPLES or not names:
        return _orphans(rec.get("orphans") or {})
    message = (
        f"{len(names)} parameter tensor(s) get gradients at every sampled step but no optimizer holds them "
        f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}), while other parameters of the same model "
        "are optimized: that part of the model never learns"
    )
    evidence = {"parameters": names[:16], "num_parameters": len(names), "sampled_steps": rec["sampled"]}
    fix = (
        "build the optimizer over model.parameters() (or every part you mean to train); freeze what should stay "
        "fixed with requires_grad_(False)"
    )
    return [Finding("invariant-grads-not-stepped", "warning", message, evidence, fix)]


def weights_collapse(facts: Any, outcome: object) -> list[Finding]:
    rec = facts.invariants.get(FAMILY, {})
    collapsed = rec.get("collapsed", [])
    if rec.get("sampled", 0) < _MIN_SAMPLES or not collapsed or len(collapsed) < _COLLAPSED_SHARE * rec["weights"]:
        return []
    decays = sorted({c["weight_decay"] for c in collapsed})
    first = collapsed[0]
    message = (
        f"{len(collapsed)} of {rec['weights']} weight tensors shrank under {_COLLAPSE:.0%} of their first norm "
        f"({first['parameter']}: {first['first_norm']:.3g} → {first['last_norm']:.3g}; weight_decay {decays}): "
        "the regulariser, not the loss, decides the weights"
    )
    evidence = {
        "parameters": [c["parameter"] for c in collapsed[:16]],
        "num_collapsed": len(collapsed),
        "num_weights": rec["weights"],
        "first_norm": first["first_norm"],
        "last_norm": first["last_norm"],
        "weight_decay": decays,
        "threshold": _COLLAPSE,
    }
    fix = "lower weight_decay (1e-4..1e-2 for SGD/Adam's L2, ~0.01..0.1 for AdamW), or check what else scales weights down"
    return [Finding("invariant-weights-collapse", "warning", message, evidence, fix)]


def unstable_settings(facts: Any, outcome: object) -> list[Finding]:
    settings = facts.invariants.get(FAMILY, {}).get("settings", [])
    if not settings:
        return _growing_schedule(facts)
    s = settings[0]
    value = f"{s['value']:g}" if isinstance(s["value"], float) else str(tuple(s["value"]))
    message = (
        f"{s['optimizer']} (optimizer {s['index']}, parameter group {s['group']}) runs with {s['key']}={value}, "
        f"outside {s['valid']}: {s['why']}"
    )
    fix = f"set {s['key'].split('[')[0]} inside {s['valid']} (momentum 0.9, betas (0.9, 0.999), alpha 0.99 are usual)"
    evidence = {"settings": settings, "threshold": s["valid"]}
    return [Finding("invariant-optimizer-settings", "warning", message, evidence, fix)]


def decay_dominates(facts: Any, outcome: object) -> list[Finding]:
    rec = facts.invariants.get(FAMILY, {})
    pulls = rec.get("pulls", {})
    strong = {n: r for n, r in pulls.items() if r >= _DOMINATES}
    if not pulls or len(strong) < _DOMINATED_SHARE * len(pulls):
        return []
    name, ratio = min(strong.items(), key=lambda kv: kv[1])
    message = (
        f"at the first steps the weight decay pulls harder than the loss's gradient on all {len(pulls)} decayed "
        f"weight tensors (weight_decay {rec.get('decays')}; even {name}, the one the loss pushes hardest: weight_decay·‖w‖ = {ratio:.3g}× ‖grad‖): the "
        "regulariser, not the data, decides where the weights go"
    )
    evidence = {
        "parameters": sorted(strong)[:16],
        "pull_over_grad": {n: round(r, 4) for n, r in sorted(strong.items())[:16]},
        "num_dominated": len(strong),
        "num_decayed": len(pulls),
        "threshold": _DOMINATES,
        "weight_decay": rec.get("decays", []),
    }
    fix = (
        "lower weight_decay (1e-5..1e-2 as an L2 term; ~0.01..0.1 with AdamW, which applies it apart from the gradient)"
    )
    return [Finding("invariant-decay-dominates", "warning", message, evidence, fix)]


def optimizer_recreated(facts: Any, outcome: object) -> list[Finding]:
    found = [r for r in facts.invariants.get(FAMILY, {}).get("recreated", []) if r["median_steps_each"] <= _FEW_STEPS]
    if not found:
        return []
    r = found[0]
    where = f" (the second made before the step at {r['file']}:{r['line']})" if r.get("file") else ""
    message = (
        f"{r['instances']} {r['optimizer']} optimizers were made over the same parameters, each stepping "
        f"{r['median_steps_each']} time(s) (the median){where}: an optimizer made anew each step starts from empty "
        "state every time (no momentum, Adam's moments reset to their first step)"
    )
    fix = "make the optimizer once, before the training loop, and step that one"
    evidence = {**r, "threshold": {"instances": _RECREATED, "median_steps_each": _FEW_STEPS}}
    return [Finding("invariant-optimizer-recreated", "warning", message, evidence, fix)]


def grads_zero(facts: Any, outcome: object) -> list[Finding]:
    rec = facts.invariants.get(FAMILY, {}).get("zero_grads") or {}
    if not rec:
        return []
    names = rec["parameters"]
    message = (
        f"{rec['num_zero']} trained parameter tensor(s) get a gradient of exactly zero at every sampled step "
        f"({', '.join(names[:4])}{', ...' if rec['num_zero'] > 4 else ''}) while {rec['num_nonzero']} others get "
        "real gradients: something between them and the loss passes no gradient (round, argmax, sign, a "
        "comparison, a clamp that always saturates, a factor of 0)"
    )
    fix = (
        "find the op between these parameters and the loss that has no gradient and use a differentiable one "
        "(softmax instead of argmax, a straight-through estimator for rounding), or freeze them on purpose"
    )
    return [Finding("invariant-grads-zero", "warning", message, {**rec}, fix)]


def _orphans(rec: dict[str, Any]) -> list[Finding]:
    """The loss's gradients reach parameters no optimizer holds, at most sampled steps."""
    if rec.get("count", 0) < _MIN_SAMPLES or 2 * rec["count"] < rec["walked"]:
        return []
    first = rec["found"][0]
    why = (
        "a model made anew while the optimizer still holds the old one's parameters"
        if not first["held_reached"]
        else "layers kept in a plain list or dict (not nn.ModuleList/ModuleDict) are not the model's parameters"
        if first["registered"] < first["num_parameters"]
        else "part of the model was left out of the optimizer"
    )
    message = (
        f"at {rec['count']} of {rec['walked']} sampled steps (from step {first['step']}) the loss's gradients reach "
        f"{first['num_parameters']} parameter tensor(s) no optimizer holds ({', '.join(first['parameters'][:4])}): "
        f"they never learn; {why}"
    )
    evidence = {**first, "steps_found": rec["count"], "steps_walked": rec["walked"]}
    fix = (
        "keep layers in nn.ModuleList/nn.ModuleDict, make the model and its optimizer together (once, before the "
        "loop), and build the optimizer over model.parameters()"
    )
    return [Finding("invariant-grads-not-stepped", "warning", message, evidence, fix)]


_CYCLIC = {"CyclicLR", "OneCycleLR"}  # schedules that rise above the rate set, on purpose
_LR_GROWTH = 10.0  # a schedule that ends this many times above the rate the optimizer was given


def _growing_schedule(facts: Any) -> list[Finding]:
    """A scheduler that drives the learning rate up, not down: it ends ≥ 10× the rate set (a gamma
    above 1, a lambda that grows where it should shrink)."""
    for s in facts.events.get("scheduler-calls", []):
        lr_set, reached = s.get("lr_set") or 0.0, s.get("lr_reached") or 0.0
        if s.get("scheduler") in _CYCLIC or lr_set <= 0 or reached < _LR_GROWTH * lr_set:
            continue
        message = (
            f"{s['scheduler']} drove the learning rate from {lr_set:.3g} up to {reached:.3g} ({reached / lr_set:.3g}×) "
            f"over {s.get('calls')} calls: a schedule meant to decay it grows it (a gamma above 1, a lambda that grows)"
        )
        evidence = {
            "scheduler": s["scheduler"],
            "lr_set": lr_set,
            "lr_reached": reached,
            "calls": s.get("calls"),
            "horizon": s.get("horizon"),
            "threshold": _LR_GROWTH,
            **{k: s[k] for k in ("file", "line") if s.get(k) is not None},
        }
        fix = "use a gamma below 1 (0.1 for StepLR, 0.9..0.99 for ExponentialLR), or a lambda that falls from 1"
        return [Finding("invariant-optimizer-settings", "warning", message, evidence, fix)]
    return []


_DISCARDED_SHARE = 0.5  # backward passes whose gradients were zeroed before any step used them
_MIN_BACKWARDS = 10


def grads_discarded(facts: Any, outcome: object) -> list[Finding]:
    """Most backward passes' gradients are cleared by ``zero_grad`` before any optimizer step uses them:
    the step runs outside the loop over batches (once an epoch), and only the last batch trains."""
    rec = facts.invariants.get(FAMILY, {}).get("backwards") or {}
    total, discarded = rec.get("total", 0), rec.get("discarded", 0)
    if total < _MIN_BACKWARDS or discarded < _DISCARDED_SHARE * total or not facts.optimizers:
        return []  # no optimizer: a hand-written update uses the gradients between backward and zero_grad
    site = rec.get("site") or {}
    where = f" (the zero_grad at {site['file']}:{site['line']})" if site.get("file") else ""
    message = (
        f"{discarded} of {total} backward passes had their gradients cleared by zero_grad before any optimizer "
        f"step used them{where}: they were computed for nothing, and only the batches just before a step train "
        "(a step() outside the loop over batches)"
    )
    evidence = {"backwards": total, "discarded": discarded, "threshold": _DISCARDED_SHARE, **site}
    fix = "call optimizer.step() after each backward (inside the batch loop), or zero the gradients only after a step"
    return [Finding("invariant-grads-discarded", "warning", message, evidence, fix)]


IDS: tuple[str, ...] = (
    "invariant-grads-discarded",
    "invariant-optimizer-recreated",
    "invariant-optimizer-settings",
    "invariant-grads-not-stepped",
    "invariant-grads-zero",
    "invariant-weights-collapse",
    "invariant-decay-dominates",
)
DETECTORS: tuple = (
    grads_discarded,
    optimizer_recreated,
    unstable_settings,
    grads_not_stepped,
    grads_zero,
    weights_collapse,
    decay_dominates,
)
EXPLAINED_BY: dict[str, set[str]] = {
    "invariant-grads-not-stepped": {"params-not-updating", "frozen-parameters", "grad-none"},
    "invariant-weights-collapse": {"lr-divergence", "grad-exploding", "params-not-updating"},
    "invariant-decay-dominates": {"params-not-updating", "frozen-parameters", "grad-none"},
    "invariant-optimizer-settings": set(),
    "invariant-optimizer-recreated": set(),
    "invariant-grads-discarded": {"zero-grad-before-step", "params-not-updating", "double-step"},
    "invariant-grads-zero": {"params-not-updating", "frozen-parameters", "grad-none", "grad-vanishing"},
}
