"""Invariants: modes (see ``diagnose.invariants``).

A model trains in training mode: the layers that behave differently in evaluation (Dropout,
BatchNorm with running statistics) are in training mode when the model is called for a step. A
model left in eval mode for its whole training (``model.eval()`` before the loop, or a ``train()``
never called) trains without dropout and with BatchNorm normalising by statistics that never
update. (A model that trained in training mode and stays in eval mode after a validation is the
named ``train-mode-not-restored``.)

At the model calls with gradients on (the first ``_FIRST``, then every ``_EVERY``-th) of a model
some optimizer trains, the listener counts those where every such layer was in eval mode.
Frozen models (a teacher, a loss network: no optimizer holds them) are left alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from torchkeel.diagnose.findings import Finding, site_fields
from torchkeel.introspect.sites import user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

FAMILY = "modes"
_FIRST = 50
_EVERY = 10
_MIN_CALLS = 5
_EVAL_SHARE = 0.9
_DROPOUT = torch.nn.modules.dropout._DropoutNd
_NORM = torch.nn.modules.batchnorm._BatchNorm


class Listener:
    """Training calls of each model, and those made with every mode-dependent layer in eval mode."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.models: dict[int, dict[str, Any]] = {}

    def on_model_called(self, module: torch.nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled() or isinstance(module, torch.nn.modules.loss._Loss):
            return
        model = self.models.get(id(module))
        if model is None:
            layers = [
                (name, m)
                for name, m in module.named_modules()
                if (isinstance(m, _DROPOUT) and m.p > 0) or (isinstance(m, _NORM) and m.track_running_stats)
            ]
            model = self.models[id(module)] = {"module": module, "layers": layers[:64], "calls": 0, "eval": 0}
        if not model["layers"]:
            return
        model["calls"] += 1
        if model["calls"] > _FIRST and model["calls"] % _EVERY:
            return
        model["sampled"] = model.get("sampled", 0) + 1
        if not any(m.training for _, m in model["layers"]):
            model["eval"] += 1
            model.setdefault("first", {"step": self.probe.next_step, **site_fields(user_site() or {})})

    def finish(self) -> None:
        held = {id(p) for opt in self.probe.state.optimizers for g in opt.param_groups for p in g["params"]}
        names = {id(m): name for m, name in self.probe.state.roots.values()}
        stuck = []
        for key, model in self.models.items():
            sampled = model.get("sampled", 0)
            if sampled < _MIN_CALLS or model["eval"] < _EVAL_SHARE * sampled:
                continue
            if not any(id(p) in held for p in model["module"].parameters()):
                continue  # frozen: evaluation mode is right for it
            if not any(isinstance(m, _DROPOUT) for _, m in model["layers"]):
                continue  # BatchNorm alone kept in eval mode: statistics frozen on purpose (a fine-tune)
            stuck.append(
                {
                    "model": names.get(key, type(model["module"]).__name__),
                    "layers": [f"{self.probe.name_of(m)} ({type(m).__name__})" for _, m in model["layers"][:8]],
                    "sampled_calls": sampled,
                    "eval_calls": model["eval"],
                    **model.get("first", {}),
                }
            )
        self.probe.facts.invariants[FAMILY] = {"stuck": stuck}


def trains_in_eval_mode(facts: Any, outcome: object) -> list[Finding]:
    stuck = (facts.invariants.get(FAMILY) or {}).get("stuck", [])
    if not stuck:
        return []
    s = stuck[0]
    message = (
        f"{s['model']} trains in eval mode: at {s['eval_calls']} of {s['sampled_calls']} sampled training calls "
        f"(from step {s.get('step')}) every mode-dependent layer was in eval mode ({', '.join(s['layers'][:4])}): "
        "dropout is off and BatchNorm normalises by running statistics it no longer updates"
    )
    evidence = {**s, "threshold": _EVAL_SHARE}
    fix = "call model.train() before the training loop (and again after each evaluation)"
    return [Finding("invariant-trains-in-eval-mode", "warning", message, evidence, fix)]


IDS: tuple[str, ...] = ("invariant-trains-in-eval-mode",)
DETECTORS: tuple = (trains_in_eval_mode,)
EXPLAINED_BY: dict[str, set[str]] = {"invariant-trains-in-eval-mode": {"train-mode-not-restored"}}
