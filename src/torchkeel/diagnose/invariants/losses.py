"""Invariants: losses (see ``diagnose.invariants``).

What every healthy run's loss satisfies, whatever its fault:

- its arguments agree: input and target of an elementwise loss have the same shape (a target that
  only broadcasts, ``(N, 1)`` against ``(N,)``, makes an ``(N, N)`` loss of every pair); targets lie
  in the range the loss expects and the prediction can reach (``_losses_arguments``); class
  targets are not the model's own integer input (a language model that forgot to shift its
  targets) nor, in a large share, the padding id its embedding declares while the loss counts it;
- the optimizer descends the loss: the backward does not start from a loss under a minus sign;
- it leaves chance level (what the best constant predictor scores on the targets seen: the
  entropy of the class frequencies for a cross entropy, the binary entropy of each label's mean
  for a binary one, each target feature's variance for a mean squared error) once the run is long
  enough to learn, and it does not fall far below it faster than learning can (leaked targets,
  a missing causal mask).

The listener chains a check onto the loss functions the probe's function mode already sees
(their ``nn`` modules call them). Arguments are checked at each call until found wrong; the
loss's own value and its targets' statistics are taken on sampled calls (the first
``_SAMPLED_FIRST`` of a call site, then every ``_SAMPLE_EVERY``-th), one extra loss evaluation
each, never per element in Python.
"""

from __future__ import annotations

import collections
import inspect
import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from torchkeel.diagnose.findings import site_fields
from torchkeel.diagnose.invariants._chance import _chance
from torchkeel.diagnose.invariants._losses_arguments import (
    BINARY,
    CLASSES,
    ELEMENTWISE,
    broadcast,
    counts_padding,
    ignores_a_class,
    negated_loss,
    target_range,
)
from torchkeel.diagnose.invariants._losses_findings import (  # noqa: F401 - the family's parts, in one place
    DETECTORS,
    EXPLAINED_BY,
    FAMILY,
    IDS,
    loss_at_chance,
    loss_broadcast,
    loss_target_range,
    loss_too_fast,
    targets_are_inputs,
)
from torchkeel.diagnose.invariants.common import chained
from torchkeel.introspect.sites import user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe


_SAMPLED_FIRST = 30
_SAMPLE_EVERY = 5
_KEPT_SAMPLES = 400


class Listener:
    """Checks each loss call's arguments; samples its value and its targets' statistics."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.int_inputs: collections.deque = collections.deque(maxlen=4)  # the latest models' integer inputs
        self.no_grad_call = False  # a model ran without gradients since the last step (its targets may be its)
        self.sites: dict[str, dict[str, Any]] = {}
        self.found: dict[str, dict[str, Any]] = {}  # argument faults by id, the first of each
        self.signatures: dict[Callable, inspect.Signature] = {}
        self.calls: dict[Callable, int] = {}  # training calls of each loss function
        self.padding_ids: set[int] = set()  # the padding ids of the trained embeddings

    def install(self) -> None:
        checks = self.probe.modules.loss_checks
        for func in CLASSES + ELEMENTWISE:
            checks[func] = chained(checks.get(func), self.check)

    # ---------------------------------------------------------------- events
    def on_model_called(self, module: torch.nn.Module, args: Any) -> None:
        if next(module.parameters(), None) is not None:  # a model, not a loss module
            self._note_ints(args)
        if not torch.is_grad_enabled():
            self.no_grad_call = True

    def on_leaf_forward(self, module: torch.nn.Module, args: Any) -> None:
        if isinstance(module, torch.nn.Embedding):  # the ids of a model called with keywords
            self._note_ints(args)
            if module.padding_idx is not None and module.weight.requires_grad:
                self.padding_ids.add(int(module.padding_idx) % module.num_embeddings)

    def on_backward_done(self, roots: list[torch.Tensor]) -> None:
        if roots and "invariant-loss-negated" not in self.found and not self.probe.state.in_step:
            op = negated_loss(roots[0])
            if op is not None:
                self._record("invariant-loss-negated", {"loss_op": op})

    def on_step_ends(self) -> None:
        self.no_grad_call = False

    def _note_ints(self, args: Any) -> None:
        """The call's first integer tensor: its input ids (a later one may be the targets it is handed)."""
        for a in args if isinstance(args, tuple) else (args,):
            if isinstance(a, torch.Tensor) and not a.is_floating_point() and a.dtype != torch.bool:
                if a.dim() >= 1 and a.numel() >= 16 and not any(a is b for b in self.int_inputs):
                    self.int_inputs.append(a)
                return

    # ---------------------------------------------------------------- the check of each call
    def check(self, func: Callable, args: Any, kwargs: dict) -> None:
        bound = self._bind(func, args, kwargs)
        x, target = bound.get("input"), bound.get("target")
        if not isinstance(x, torch.Tensor) or not isinstance(target, torch.Tensor) or not target.numel():
            return
        if func in ELEMENTWISE and "invariant-loss-broadcast" not in self.found:
            self._record("invariant-loss-broadcast", broadcast(func, x, target))
        if "invariant-loss-target-range" not in self.found:
            self._record("invariant-loss-target-range", target_range(func, bound, x, target.detach()))
        if not (torch.is_grad_enabled() and x.requires_grad):
            return  # an evaluation's loss: its arguments are checked, its value is not the training's
        calls = self.calls[func] = self.calls.get(func, 0) + 1
        if calls > _SAMPLED_FIRST and calls % _SAMPLE_EVERY:
            return
        where = user_site() or {}
        site = self.sites.setdefault(_key(func, where), _new_site(func, where))
        if func in CLASSES and not target.is_floating_point():
            if "invariant-loss-targets-are-inputs" not in self.found:
                self._targets_are_inputs(func, bound, x, target, where)
            if self._per_token(target) and "invariant-loss-counts-padding" not in self.found:
                found = counts_padding(bound, target.detach(), self.padding_ids)
                self._record("invariant-loss-counts-padding", found and {"loss": func.__name__, **found})
            if not site["lm"]:
                site["lm"] = self._shifted_inputs(bound, target)
            if "invariant-loss-target-range" not in self.found and not self._token_targets(target):
                found = ignores_a_class(bound, x, target.detach())
                self._record("invariant-loss-target-range", found and {"loss": func.__name__, **found})
        self._sample(site, func, bound, x, target)

    def _bind(self, func: Callable, args: Any, kwargs: dict) -> dict[str, Any]:
        sig = self.signatures.get(func)
        if sig is None:
            sig = self.signatures[func] = inspect.signature(func)
        try:
            return dict(sig.bind(*args, **kwargs).arguments)
        except TypeError:
            return {}

    def _record(self, finding_id: str, fields: dict[str, Any] | None) -> None:
        if fields is not None:
            self.found.setdefault(
                finding_id, {"step": self.probe.next_step, **fields, **site_fields(user_site() or {})}
            )

    def _per_token(self, target: torch.Tensor) -> bool:
        """Targets one a token of an integer input (tagging, next-token prediction), not one a sequence."""
        return bool(self.padding_ids) and self._token_targets(target)

    def _token_targets(self, target: torch.Tensor) -> bool:
        return any(inp.numel() == target.numel() and inp.dim() >= 2 for inp in self.int_inputs)

    def _shifted_inputs(self, bound: dict[str, Any], target: torch.Tensor) -> bool:
        """The targets are an integer input shifted by one position: next-token prediction (the
        targets may come flattened, as ``cross_entropy`` of ``(B·T, V)`` logits takes them)."""
        for inp in self.int_inputs:
            if inp.dim() != 2 or inp.shape[1] < 4 or inp.numel() != target.numel() or inp.device != target.device:
                continue
            rows, targets = inp.detach(), target.detach().reshape(inp.shape)
            if bool((rows[:, 1:] == targets[:, :-1]).all()):
                return True
        return False

    def _targets_are_inputs(
        self, func: Callable, bound: dict[str, Any], x: torch.Tensor, target: torch.Tensor, where: dict[str, Any]
    ) -> None:
        ignore = bound.get("ignore_index", -100)
        flat = target.detach().reshape(-1)
        keep = flat != ignore
        if int(keep.sum()) < 16:
            return
        for inp in self.int_inputs:
            if inp.numel() != flat.numel() or inp.device != flat.device:
                continue
            same = inp.detach().reshape(-1)[keep] == flat[keep]
            if bool(same.all()) and int(flat[keep].unique().numel()) >= 2:
                self.found["invariant-loss-targets-are-inputs"] = {
                    "step": self.probe.next_step,
                    "loss": func.__name__,
                    "target_shape": list(target.shape),
                    "input_shape": list(inp.shape),
                    "num_targets": int(keep.sum()),
                    **site_fields(where),
                }
                return

    def _sample(
        self, site: dict[str, Any], func: Callable, bound: dict[str, Any], x: torch.Tensor, target: torch.Tensor
    ) -> None:
        """The loss's own value now, and the statistics of its targets (for chance level)."""
        if len(site["samples"]) >= _KEPT_SAMPLES or site["kind"] is None:
            return
        site["model_targets"] += self.no_grad_call or target.requires_grad
        weighted = any(bound.get(k) is not None for k in ("weight", "pos_weight")) or bound.get("label_smoothing", 0)
        if weighted or bound.get("reduction", "mean") != "mean" or bound.get("size_average") is not None:
            site["kind"] = None  # a chance level this probe does not know
            return
        with torch.no_grad():
            stats = _target_stats(site["kind"], func, bound, x.detach(), target.detach())
            if stats is None:
                return
            with warnings.catch_warnings():  # the call itself warns the user once already
                warnings.simplefilter("ignore")
                value = float(func(**{**bound, "input": x.detach()}))
        if not math.isfinite(value):
            return
        _accumulate(site, stats)
        site["samples"].append([self.probe.next_step, value])

    def finish(self) -> None:
        sites = {}
        for key, site in self.sites.items():
            if site["samples"]:
                chance, floor = _chance(site)
                sites[key] = {k: site[k] for k in ("loss", "file", "line", "samples", "model_targets", "lm")}
                features = int(site["sum"].numel()) if site["sum"] is not None else 0
                sites[key].update(chance=chance, floor=floor, num_sampled=len(site["samples"]), features=features)
        self.probe.facts.invariants[FAMILY] = {"arguments": self.found, "sites": sites}


def _key(func: Callable, where: dict[str, Any]) -> str:
    return f"{func.__name__} at {where.get('file')}:{where.get('line')}"


def _new_site(func: Callable, where: dict[str, Any]) -> dict[str, Any]:
    kind = "classes" if func in CLASSES else "binary" if func in BINARY else "squared" if func is F.mse_loss else None
    return {
        "loss": func.__name__,
        "kind": kind,
        "calls": 0,
        "samples": [],
        "model_targets": 0,
        "lm": False,
        "file": where.get("file"),
        "line": where.get("line"),
        "sum": None,
        "sumsq": None,
        "rows": 0,
        "floor_sum": 0.0,
        "elements": 0,
    }


def _target_stats(kind: str, func: Callable, bound: dict[str, Any], x: torch.Tensor, t: torch.Tensor) -> Any:
    """Per-feature (sum, sum of squares, rows, floor sum, elements) of one call's targets, or None.

    Classes: the class mass (a one-hot or soft row per target); binary: each label's mean and the
    targets' own entropy (the floor a soft target leaves); squared: each feature's moments."""
    if kind == "classes":
        if x.dim() < 1:
            return None
        num_classes = int(x.shape[1] if x.dim() >= 2 else x.shape[0])
        if t.is_floating_point():
            if t.shape != x.shape:
                return None
            rows = t.movedim(1, -1).reshape(-1, num_classes) if t.dim() >= 2 else t.reshape(1, -1)
            rows = rows.double()
            floor = float(-(rows * rows.clamp_min(1e-12).log()).sum())
            return rows.sum(0), None, rows.shape[0], floor, rows.shape[0]
        valid = t[t != bound.get("ignore_index", -100)].reshape(-1)
        if not valid.numel() or int(valid.min()) < 0 or int(valid.max()) >= num_classes:
            return None
        return torch.bincount(valid, minlength=num_classes).double(), None, valid.numel(), 0.0, valid.numel()
    if t.shape != x.shape or t.dim() < 1 or not t.is_floating_point():
        return None
    rows = t.reshape(t.shape[0], -1).double()
    if kind == "binary":
        inside = rows.clamp(1e-12, 1 - 1e-12)
        floor = float(-(rows * inside.log() + (1 - rows) * (1 - inside).log()).sum())
        return rows.sum(0), None, rows.shape[0], floor, rows.numel()
    return rows.sum(0), (rows * rows).sum(0), rows.shape[0], 0.0, rows.numel()


def _accumulate(site: dict[str, Any], stats: Any) -> None:
    total, squares, rows, floor, elements = stats
    if site["sum"] is not None and site["sum"].shape != total.shape:
        # Features that change in number (sequences of varying length): their totals only.
        site["sum"], site["sumsq"] = (
            site["sum"].sum().reshape(1),
            None if site["sumsq"] is None else site["sumsq"].sum().reshape(1),
        )
        total = total.sum().reshape(1)
        squares = None if squares is None else squares.sum().reshape(1)
        site["pooled"] = True
    elif site.get("pooled"):
        total, squares = total.sum().reshape(1), None if squares is None else squares.sum().reshape(1)
    site["sum"] = total if site["sum"] is None else site["sum"] + total
    if squares is not None:
        site["sumsq"] = squares if site["sumsq"] is None else site["sumsq"] + squares
    site["rows"] += rows
    site["floor_sum"] += floor
    site["elements"] += elements
