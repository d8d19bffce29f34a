"""Invariants: what the optimizers do to the model (see ``diagnose.invariants``).

- Every parameter that gets gradients is updated: a model whose layers receive gradients step after
  step while its optimizer holds only some of them (``Adam(model.fc.parameters())`` where the whole
  model was meant) trains part of itself.
- The weights do not collapse: training moves weights, it does not shrink them to nothing. Weight
  tensors whose norm falls under 5 % of where it started (a weight decay of 1.0) have lost what they
  learnt to the regulariser.
- The loss, not the regulariser, moves the weights at the start: an L2 weight decay added to the
  gradient (``SGD``/``Adam``'s ``weight_decay``) pulls with ``wd·‖w‖`` against the loss's ``‖g‖``; a
  pull larger than the gradient over the first steps on every decayed weight tensor, even the one
  the loss pushes hardest, is a decay orders of magnitude above the usual 1e-5..1e-2 (healthy
  corpus, weight decay 5e-4: the hardest-pushed tensor's pull is 0.0014 and 0.0103 of its gradient).
- Every trained parameter gets a gradient: one whose gradient is exactly zero at every sampled step,
  beside others that move, sits behind an op with no gradient (round, argmax, a comparison).
- An optimizer lives through the run: its state (momentum, Adam's moments) builds up over steps.
  Five or more optimizer objects made over the same parameters, each stepping at most twice (the
  median), are an optimizer made anew inside the loop.
- Every running average an optimizer keeps forgets: ``momentum``, ``betas``, ``alpha`` and ``rho``
  lie in [0, 1) (at 1 the average never decays and the steps grow without bound) and the learning
  rate is not negative (a negative one climbs the loss). PyTorch checks some of these, not all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from torchkeel.diagnose.findings import Finding, site_fields
from torchkeel.diagnose.invariants.updates import is_sampled
from torchkeel.introspect.sites import user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

FAMILY = "optimizers"
_MIN_SAMPLES = 3
_UNSTEPPED_SHARE = 0.9  # sampled steps at which the same parameters had gradients and no optimizer
_UNSTEPPED_SIZE = 0.01  # ... together this share of the model's elements, at least
_COLLAPSE = 0.05  # a weight tensor's norm under this fraction of its first: collapsed
_COLLAPSED_SHARE = 0.5  # ... for at least this share of the weight tensors
_MIN_WEIGHT_NORM = 1e-3
_DOMINATES = 1.0  # the decay's pull over the loss's gradient, median of the first sampled steps
_DOMINATED_SHARE = 1.0  # ... for every decayed weight tensor: even the one the loss pushes hardest (a block
# behind a zero-initialised BatchNorm gets almost no gradient at first, however small the decay)
_FIRST_STEPS = 5
_AVERAGES = ("momentum", "alpha", "rho")  # running-average coefficients, each in [0, 1)
_RECREATED = 5  # optimizer objects made over the same parameters ...
_FEW_STEPS = 2  # ... each stepping this many times or fewer (the median): its state never builds up


class Listener:
    """At sampled optimizer steps: parameters with gradients that no optimizer holds, and weight norms."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.sampled = 0
        self.unstepped: dict[str, int] = {}  # parameter name → sampled steps it had a gradient and no optimizer
        self.sizes: dict[str, int] = {}  # ... and its number of elements
        self.trainable = 0  # the elements of the largest trained model
        self.first_norms: dict[int, float] = {}
        self.last_norms: dict[int, float] = {}
        self.names: dict[int, str] = {}
        self.decay: dict[int, float] = {}
        self.pulls: dict[int, list[float]] = {}  # weight tensor → wd·‖w‖ / ‖g‖ at the first sampled steps
        self.settings: list[dict[str, Any]] = []
        self.checked: set[int] = set()
        self.instances: dict[tuple[int, int], dict[str, Any]] = {}  # optimizers over the same parameters
        self.zero_grads: dict[int, list[Any]] = {}  # parameter → [name, sampled steps with a .grad, any non-zero]

    def on_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        probe = self.probe
        self._note_instance(optimizer)
        if not is_sampled(probe.next_step) or probe.light:
            return
        self.sampled += 1
        if id(optimizer) not in self.checked:
            self.checked.add(id(optimizer))
            self.settings += _unstable_settings(optimizer, probe.state.optimizers.index(optimizer))
        held = {id(p) for opt in probe.state.optimizers for g in opt.param_groups for p in g["params"]}
        names = probe.param_names()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.dim() >= 2 and not p.is_meta:
                    norm = float(p.detach().norm())
                    self.first_norms.setdefault(id(p), norm)
                    self.last_norms[id(p)] = norm
                    self.names[id(p)] = names.get(id(p), f"a {tuple(p.shape)} tensor")
                    self.decay[id(p)] = float(group.get("weight_decay", 0.0) or 0.0)
                    if probe.next_step <= _FIRST_STEPS and self.decay[id(p)] > 0 and _coupled(optimizer, group):
                        self._pull(p, self.decay[id(p)], norm)
                if p.requires_grad and p.grad is not None and not p.grad.is_sparse:
                    seen = self.zero_grads.setdefault(id(p), [names.get(id(p), f"a {tuple(p.shape)} tensor"), 0, False])
                    seen[1] += 1
                    seen[2] = seen[2] or bool(p.grad.any())
        for root, _ in probe.state.roots.values():
            params = list(root.parameters())
            if not any(id(p) in held for p in params):
                continue  # a model no optimizer trains (a frozen teacher, a loss network): not this invariant
            for p in params:
                if id(p) not in held and p.grad is not None and not p.grad.is_sparse and bool(p.grad.any()):
                    name = names.get(id(p), "?")
                    self.unstepped[name] = self.unstepped.get(name, 0) + 1
                    self.sizes[name] = p.numel()
            self.trainable = max(self.trainable, sum(p.numel() for p in params))

    def _note_instance(self, optimizer: torch.optim.Optimizer) -> None:
        """Steps taken by each optimizer object, by the parameters it holds (its first one and its count)."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if not params:
            return
        key = (id(params[0]), len(params))
        instances = self.instances.setdefault(key, {"class": type(optimizer).__name__, "steps": {}, "first_step": None})
        if len(instances["steps"]) < 10_000:
            instances["steps"][id(optimizer)] = instances["steps"].get(id(optimizer), 0) + 1
        if len(instances["steps"]) == 2 and instances["first_step"] is None:
            instances["first_step"] = self.probe.next_step
            instances.update(site_fields(user_site() or {}))

    def _pull(self, p: torch.Tensor, decay: float, norm: float) -> None:
        if p.grad is None or p.grad.is_sparse:
            return
        grad = float(p.grad.detach().norm())
        if grad > 0 and norm > _MIN_WEIGHT_NORM:
            self.pulls.setdefault(id(p), []).append(decay * norm / grad)

    def finish(self) -> None:
        pulls = {self.names[i]: sorted(r)[len(r) // 2] for i, r in self.pulls.items()}
        collapsed = [
            {
                "parameter": self.names[i],
                "first_norm": first,
                "last_norm": self.last_norms[i],
                "weight_decay": self.decay[i],
            }
            for i, first in self.first_norms.items()
            if first > _MIN_WEIGHT_NORM and self.last_norms[i] < _COLLAPSE * first
        ]
        self.probe.facts.invariants[FAMILY] = {
            "sampled": self.sampled,
            "unstepped": _unstepped(self.unstepped, self.sizes, self.sampled, self.trainable),
            "weights": len(self.first_norms),
            "collapsed": collapsed,
            "pulls": pulls,
            "decays": sorted({self.decay[i] for i in self.pulls}),
            "settings": self.settings,
            "zero_grads": _always_zero(self.zero_grads),
            "recreated": [_recreated(i) for i in self.instances.values() if len(i["steps"]) >= _RECREATED],
        }


def _unstepped(counts: dict[str, int], sizes: dict[str, int], sampled: int, trainable: int) -> dict[str, int]:
    """The parameters left out at ≥ ``_UNSTEPPED_SHARE`` of the sampled steps, when together they are
    ≥ ``_UNSTEPPED_SIZE`` of the model (a scalar left at its start, a temperature, is no part of it
    that fails to learn)."""
    left = {n: c for n, c in counts.items() if c >= _UNSTEPPED_SHARE * sampled}
    return left if sum(sizes[n] for n in left) >= _UNSTEPPED_SIZE * trainable else {}


def _always_zero(seen: dict[int, list[Any]]) -> dict[str, Any]:
    """The parameters whose gradient was all zeros at every one of ≥ ``_MIN_SAMPLES`` sampled steps,
    beside others whose gradient was not."""
    zero = sorted(name for name, count, nonzero in seen.values() if count >= _MIN_SAMPLES and not nonzero)
    moving = sum(nonzero for _, _, nonzero in seen.values())
    return {"parameters": zero[:16], "num_zero": len(zero), "num_nonzero": moving} if zero and moving else {}


def _recreated(instances: dict[str, Any]) -> dict[str, Any]:
    counts = sorted(instances["steps"].values())
    return {
        "optimizer": instances["class"],
        "instances": len(counts),
        "median_steps_each": counts[len(counts) // 2],
        "step": instances["first_step"],
        **site_fields(instances),
    }


def _coupled(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Weight decay added to the gradient (L2), not applied to the weights apart (AdamW's)."""
    return not isinstance(optimizer, torch.optim.AdamW) and not group.get("decoupled_weight_decay", False)


def _unstable_settings(optimizer: torch.optim.Optimizer, index: int) -> list[dict[str, Any]]:
    """The settings of each parameter group outside the range where the optimizer converges."""
    found = []
    for g, group in enumerate(optimizer.param_groups):
        values = [(k, group[k]) for k in _AVERAGES if isinstance(group.get(k), (int, float))]
        values += [(f"betas[{i}]", b) for i, b in enumerate(group.get("betas") or ()) if isinstance(b, (int, float))]
        for key, value in values:
            if not 0.0 <= float(value) < 1.0:
                found.append({"key": key, "value": float(value), "valid": "[0, 1)"})
        lr = group.get("lr")
        if isinstance(lr, (int, float)) and lr < 0:
            found.append({"key": "lr", "value": float(lr), "valid": ">= 0"})
    return [{"optimizer": type(optimizer).__name__, "index": index, "group": g, **f} for f in found[:4]]


def grads_not_stepped(facts: Any, outcome: object) -> list[Finding]:
    rec = facts.invariants.get(FAMILY, {})
    names = sorted(rec.get("unstepped", {}))
    if rec.get("sampled", 0) < _MIN_SAMPLES or not names:
        return []
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
        return []
    s = settings[0]
    message = (
        f"{s['optimizer']} (optimizer {s['index']}, parameter group {s['group']}) runs with {s['key']}={s['value']:g}, "
        f"outside {s['valid']}: "
        + (
            "a negative learning rate climbs the loss"
            if s["key"] == "lr"
            else "a running average with a coefficient of 1 or more never forgets, and the steps grow without bound"
        )
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


IDS: tuple[str, ...] = (
    "invariant-optimizer-recreated",
    "invariant-optimizer-settings",
    "invariant-grads-not-stepped",
    "invariant-grads-zero",
    "invariant-weights-collapse",
    "invariant-decay-dominates",
)
DETECTORS: tuple = (
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
    "invariant-grads-zero": {"params-not-updating", "frozen-parameters", "grad-none", "grad-vanishing"},
}
