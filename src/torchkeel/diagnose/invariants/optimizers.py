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
- Every trained weight gets a gradient: a weight tensor (≥ 2 dimensions: a bias cancels in a
  difference of two scores, on purpose) whose gradient is exactly zero at every sampled step, beside
  others that move, sits behind an op with no gradient (round, argmax, a comparison).
- An optimizer lives through the run: its state (momentum, Adam's moments) builds up over steps.
  Five or more optimizer objects made over the same parameters, each stepping at most twice (the
  median), are an optimizer made anew inside the loop.
- Every running average an optimizer keeps forgets: ``momentum``, ``betas``, ``alpha`` and ``rho``
  lie in [0, 1) (at 1 the average never decays and the steps grow without bound) and the learning
  rate is not negative (a negative one climbs the loss). PyTorch checks some of these, not all.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

from torchkeel.diagnose.findings import site_fields
from torchkeel.diagnose.invariants._optimizers_findings import (  # noqa: F401 - the family's parts, in one place
    _COLLAPSE,
    _MIN_SAMPLES,
    _RECREATED,
    DETECTORS,
    EXPLAINED_BY,
    FAMILY,
    IDS,
    decay_dominates,
    grads_discarded,
    grads_not_stepped,
    grads_zero,
    optimizer_recreated,
    unstable_settings,
    weights_collapse,
)
from torchkeel.diagnose.invariants.updates import is_sampled
from torchkeel.introspect.sites import user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

_UNSTEPPED_SHARE = 0.9  # sampled steps at which the same parameters had gradients and no optimizer
_UNSTEPPED_SIZE = 0.01  # ... together this share of the model's elements, at least
_MIN_WEIGHT_NORM = 1e-3
_FIRST_STEPS = 5
_RECURRENT_STEP = re.compile(r"weight_hh_l\d+(_reverse)?$")
_AVERAGES = ("momentum", "alpha", "rho")  # running-average coefficients, each in [0, 1)


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
        self.backwards: dict[str, Any] = {"total": 0, "pending": 0, "discarded": 0, "site": None}
        self.orphan_steps: dict[int, None] = {}  # sampled steps whose graph was walked
        self.orphans: list[dict[str, Any]] = []  # ... and what it reached that no optimizer holds
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
                if p.requires_grad and p.dim() >= 2 and p.grad is not None and not p.grad.is_sparse:
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

    def on_backward_counted(self) -> None:
        if not self.probe.state.in_step:
            self.backwards["total"] += 1
            self.backwards["pending"] += 1

    def on_step_begins(self) -> None:
        self.backwards["pending"] = 0

    def on_zero_grad(self, owner: Any) -> None:
        """Gradients of backward passes no step used, cleared: they were computed for nothing."""
        pending, self.backwards["pending"] = self.backwards["pending"], 0
        if pending and not self.probe.state.in_step:
            self.backwards["discarded"] += pending
            if self.backwards["site"] is None:
                self.backwards["site"] = {"step": self.probe.next_step, **site_fields(user_site() or {})}

    def on_backward_done(self, roots: list[torch.Tensor]) -> None:
        """The parameters the loss's gradients reach (the graph's leaves) that no optimizer holds: a
        layer kept in a plain list (not registered), or a model made anew while the optimizer holds
        the old one. A model no optimizer trains (a loss network) counts only when no parameter an
        optimizer holds is reached at all."""
        probe = self.probe
        if probe.light or not probe.state.optimizers or not is_sampled(probe.next_step):
            return
        if not roots or roots[0].grad_fn is None or probe.next_step in self.orphan_steps:
            return
        held = {id(p) for opt in probe.state.optimizers for g in opt.param_groups for p in g["params"]}
        leaves = _parameter_leaves(roots[0].grad_fn)
        reached_held = any(id(p) in held for p in leaves)
        registered = {id(p): root for root, _ in probe.state.roots.values() for p in root.parameters()}
        trained_roots = {id(r) for r, _ in probe.state.roots.values() if any(id(p) in held for p in r.parameters())}
        orphans = [
            p
            for p in leaves
            if id(p) not in held
            and (id(p) not in registered or id(registered[id(p)]) in trained_roots or not reached_held)
        ]
        self.orphan_steps[probe.next_step] = None
        # as a share of the model (a temperature left at 1 is no part of it that fails to learn)
        total = max(sum(p.numel() for p in leaves), self.trainable)
        if orphans and sum(p.numel() for p in orphans) >= _UNSTEPPED_SIZE * total:
            names = probe.param_names()
            self.orphans.append(
                {
                    "step": probe.next_step,
                    "parameters": [names.get(id(p), f"an unregistered {tuple(p.shape)} Parameter") for p in orphans][
                        :8
                    ],
                    "num_parameters": len(orphans),
                    "registered": sum(id(p) in registered for p in orphans),
                    "held_reached": reached_held,
                    **site_fields(user_site() or {}),
                }
            )

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
            "backwards": {k: v for k, v in self.backwards.items() if k != "pending"},
            "orphans": {"walked": len(self.orphan_steps), "found": self.orphans[:8], "count": len(self.orphans)},
            "recreated": [_recreated(i) for i in self.instances.values() if len(i["steps"]) >= _RECREATED],
        }


def _unstepped(counts: dict[str, int], sizes: dict[str, int], sampled: int, trainable: int) -> dict[str, int]:
    """The parameters left out at ≥ ``_UNSTEPPED_SHARE`` of the sampled steps, when together they are
    ≥ ``_UNSTEPPED_SIZE`` of the model (a scalar left at its start, a temperature, is no part of it
    that fails to learn)."""
    left = {n: c for n, c in counts.items() if c >= _UNSTEPPED_SHARE * sampled}
    return left if sum(sizes[n] for n in left) >= _UNSTEPPED_SIZE * trainable else {}


def _parameter_leaves(node: Any, limit: int = 20_000) -> list[torch.nn.Parameter]:
    """The parameters a backward from ``node`` accumulates into (its graph's leaves), once each."""
    seen, stack, found = set(), [node], {}
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.nn.Parameter):
            found[id(variable)] = variable
        stack.extend(f for f, _ in node.next_functions)
    return list(found.values())


def _always_zero(seen: dict[int, list[Any]]) -> dict[str, Any]:
    """The parameters whose gradient was all zeros at every one of ≥ ``_MIN_SAMPLES`` sampled steps,
    beside others whose gradient was not. A recurrent layer's hidden-to-hidden weights are left out:
    they get none where one step alone reaches the loss from a zero state (a bidirectional layer's
    reverse direction read at the last step), which is how the output is read, not a blocked op."""
    zero = sorted(
        name
        for name, count, nonzero in seen.values()
        if count >= _MIN_SAMPLES and not nonzero and not _RECURRENT_STEP.search(name)
    )
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
        betas = [b for b in group.get("betas") or () if isinstance(b, (int, float))]
        values += [(f"betas[{i}]", b) for i, b in enumerate(betas)]
        for key, value in values:
            if not 0.0 <= float(value) < 1.0:
                found.append({"group": g, "key": key, "value": float(value), "valid": "[0, 1)", "why": _NEVER_FORGETS})
        if len(betas) == 2 and 0 <= betas[1] < 1 and betas[0] ** 2 >= betas[1] ** 0.5:
            found.append(
                {"group": g, "key": "betas", "value": list(betas), "valid": "betas[0]² < √betas[1]", "why": _BETAS}
            )
        lr = group.get("lr")
        if isinstance(lr, (int, float)) and lr < 0:
            found.append(
                {"group": g, "key": "lr", "value": float(lr), "valid": ">= 0", "why": "a negative rate climbs the loss"}
            )
    return [{"optimizer": type(optimizer).__name__, "index": index, **f} for f in found[:4]]


_NEVER_FORGETS = "a running average with a coefficient of 1 or more never forgets, and the steps grow without bound"
_BETAS = (
    "the second moment forgets faster than the first (Adam converges for betas[0]² < √betas[1], Kingma & Ba "
    "2015; betas swapped?)"
)
