"""Invariants: what the optimizers do to the model (see ``diagnose.invariants``).

- Every parameter that gets gradients is updated: a model whose layers receive gradients step after
  step while its optimizer holds only some of them (``Adam(model.fc.parameters())`` where the whole
  model was meant) trains part of itself.
- The weights do not collapse: training moves weights, it does not shrink them to nothing. Weight
  tensors whose norm falls under 5 % of where it started (a weight decay of 1.0) have lost what they
  learnt to the regulariser.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from torchkeel.diagnose.findings import Finding
from torchkeel.diagnose.invariants.updates import is_sampled

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

FAMILY = "optimizers"
_MIN_SAMPLES = 3
_UNSTEPPED_SHARE = 0.9  # sampled steps at which the same parameters had gradients and no optimizer
_COLLAPSE = 0.05  # a weight tensor's norm under this fraction of its first: collapsed
_COLLAPSED_SHARE = 0.5  # ... for at least this share of the weight tensors
_MIN_WEIGHT_NORM = 1e-3


class Listener:
    """At sampled optimizer steps: parameters with gradients that no optimizer holds, and weight norms."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.sampled = 0
        self.unstepped: dict[str, int] = {}  # parameter name → sampled steps it had a gradient and no optimizer
        self.first_norms: dict[int, float] = {}
        self.last_norms: dict[int, float] = {}
        self.names: dict[int, str] = {}
        self.decay: dict[int, float] = {}

    def on_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        probe = self.probe
        if not is_sampled(probe.next_step) or probe.light:
            return
        self.sampled += 1
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
        for root, _ in probe.state.roots.values():
            params = list(root.parameters())
            if not any(id(p) in held for p in params):
                continue  # a model no optimizer trains (a frozen teacher, a loss network): not this invariant
            for p in params:
                if id(p) not in held and p.grad is not None and not p.grad.is_sparse and bool(p.grad.any()):
                    name = names.get(id(p), "?")
                    self.unstepped[name] = self.unstepped.get(name, 0) + 1

    def finish(self) -> None:
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
            "unstepped": {n: c for n, c in self.unstepped.items() if c >= _UNSTEPPED_SHARE * self.sampled},
            "weights": len(self.first_norms),
            "collapsed": collapsed,
        }


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


IDS: tuple[str, ...] = ("invariant-grads-not-stepped", "invariant-weights-collapse")
DETECTORS: tuple = (grads_not_stepped, weights_collapse)
EXPLAINED_BY: dict[str, set[str]] = {
    "invariant-grads-not-stepped": {"params-not-updating", "frozen-parameters", "grad-none"},
    "invariant-weights-collapse": {"lr-divergence", "grad-exploding", "params-not-updating"},
}
