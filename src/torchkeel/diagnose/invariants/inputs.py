"""Invariants: the model's inputs in training and in evaluation (see ``diagnose.invariants``).

A model is evaluated on data prepared as its training data was: the inputs it sees without
gradients (or in eval mode) have about the mean and spread of the ones it trained on, and so do a
regression loss's targets (targets standardised for training and left raw for evaluation). A
normalisation, scaling or transform applied in the training loop only (or in the evaluation only)
moves one of them by a large factor, and the evaluation then measures a model on data it never
saw. Healthy splits of one dataset differ by a few percent; augmentation changes the spread by
well under 2× (a denoising autoencoder's noise at 0.5 on [0, 1] images: 1.9×).

Each model's first floating tensor argument is summarised (its element count, sum and sum of
squares: two reductions, one host transfer) on the first ``_FIRST`` calls of each mode, then every
``_EVERY``-th.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchkeel.diagnose.findings import Finding, site_fields
from torchkeel.diagnose.invariants._losses_arguments import REGRESSION
from torchkeel.diagnose.invariants.common import chained
from torchkeel.introspect.sites import tensors_in, user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

FAMILY = "inputs"
_FIRST = 30
_EVERY = 5
_SPREAD = 2.5  # the evaluation inputs' standard deviation over the training ones' (or its inverse)
_SHIFT = 1.5  # the difference of their means, in training standard deviations
_MIN_CALLS = {"train": 5, "eval": 2}
_MIN_ELEMENTS = 64
_MIN_TARGETS = 16


class Listener:
    """Running moments of each model's inputs and of each regression loss's targets, apart for
    training and evaluation calls."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.models: dict[int, dict[str, Any]] = {}

    def install(self) -> None:
        checks = self.probe.modules.loss_checks
        for func in REGRESSION:
            checks[func] = chained(checks.get(func), self.check_targets)

    def check_targets(self, func: Callable, args: Any, kwargs: dict) -> None:
        x = args[0] if args else kwargs.get("input")
        t = args[1] if len(args) > 1 else kwargs.get("target")
        if not isinstance(x, torch.Tensor) or not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return
        mode = "train" if torch.is_grad_enabled() and x.requires_grad else "eval"
        key = id(func)
        entry = self.models.setdefault(key, {"module": None, "name": f"the targets of {func.__name__}"})
        entry.setdefault("train", _moments())
        entry.setdefault("eval", _moments())
        self._note(entry[mode], t, _MIN_TARGETS)

    def on_model_called(self, module: torch.nn.Module, args: Any) -> None:
        if isinstance(module, torch.nn.modules.loss._Loss) or next(module.parameters(), None) is None:
            return
        x = next((t for t in tensors_in(args) if t.is_floating_point() and not t.is_complex()), None)
        if x is None:
            return
        mode = "train" if torch.is_grad_enabled() and module.training else "eval"
        model = self.models.setdefault(id(module), {"module": module, "train": _moments(), "eval": _moments()})
        self._note(model[mode], x, _MIN_ELEMENTS)

    def _note(self, moments: dict[str, Any], x: torch.Tensor, min_elements: int) -> None:
        if x.numel() < min_elements or x.is_meta:
            return
        moments["calls"] += 1
        if moments["calls"] > _FIRST and moments["calls"] % _EVERY:
            return
        with torch.no_grad():
            flat = x.detach().reshape(-1).double()
            total, squares = torch.stack((flat.sum(), (flat * flat).sum())).tolist()
        moments["n"] += flat.numel()
        moments["sum"] += total
        moments["sumsq"] += squares
        if moments["site"] is None:
            moments["site"] = {"step": self.probe.next_step, **site_fields(user_site() or {})}

    def finish(self) -> None:
        names = {id(m): name for m, name in self.probe.state.roots.values()}
        models = []
        for key, model in self.models.items():
            summary = {mode: _summary(model[mode]) for mode in ("train", "eval")}
            if all(summary[m]["calls"] >= _MIN_CALLS[m] and summary[m]["std"] is not None for m in _MIN_CALLS):
                name = model.get("name") or names.get(key, type(model["module"]).__name__)
                models.append({"model": name, "kind": "targets" if model["module"] is None else "inputs", **summary})
        self.probe.facts.invariants[FAMILY] = {"models": models}


def _moments() -> dict[str, Any]:
    return {"calls": 0, "n": 0, "sum": 0.0, "sumsq": 0.0, "site": None}


def _summary(m: dict[str, Any]) -> dict[str, Any]:
    if not m["n"] or not math.isfinite(m["sum"]) or not math.isfinite(m["sumsq"]):
        return {"calls": m["calls"], "mean": None, "std": None, **(m["site"] or {})}
    mean = m["sum"] / m["n"]
    std = math.sqrt(max(m["sumsq"] / m["n"] - mean * mean, 0.0))
    return {"calls": m["calls"], "mean": mean, "std": std, **(m["site"] or {})}


def eval_inputs_shifted(facts: Any, outcome: object) -> list[Finding]:
    for m in (facts.invariants.get(FAMILY) or {}).get("models", []):
        train, ev = m["train"], m["eval"]
        if train["std"] <= 1e-12:
            continue
        spread = ev["std"] / train["std"]
        shift = abs(ev["mean"] - train["mean"]) / train["std"]
        if 1 / _SPREAD < spread < _SPREAD and shift < _SHIFT:
            continue
        where = f" (evaluation call at {ev['file']}:{ev['line']})" if ev.get("file") else ""
        what = (
            f"{m['model']} is evaluated on inputs" if m.get("kind") != "targets" else f"{m['model']} in evaluation are"
        )
        message = (
            f"{what} unlike those it trains on{where}: mean {ev['mean']:.4g} and "
            f"standard deviation {ev['std']:.4g} in evaluation, {train['mean']:.4g} and {train['std']:.4g} in "
            f"training ({spread:.2f}× the spread, means {shift:.2f} training deviations apart)"
        )
        evidence = {
            "model": m["model"],
            "train": train,
            "eval": ev,
            "spread_ratio": round(spread, 4),
            "mean_shift": round(shift, 4),
            "threshold": {"spread": _SPREAD, "shift": _SHIFT},
            **{k: ev[k] for k in ("file", "line", "step") if k in ev},
        }
        fix = (
            "prepare evaluation inputs exactly as training inputs (the same normalisation and scaling, in the "
            "dataset's transform rather than in the training loop only)"
        )
        return [Finding("invariant-eval-inputs-shifted", "warning", message, evidence, fix)]
    return []


IDS: tuple[str, ...] = ("invariant-eval-inputs-shifted",)
DETECTORS: tuple = (eval_inputs_shifted,)
EXPLAINED_BY: dict[str, set[str]] = {"invariant-eval-inputs-shifted": {"augmentation-in-evaluation", "input-scale"}}
