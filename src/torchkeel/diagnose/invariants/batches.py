"""Invariants: the batches a model trains on (see ``diagnose.invariants``).

- The loader's batches reach the model: while a DataLoader hands out new batches, the data a model
  trains on changes too. A loop that fetches batch after batch while the model sees the same rows
  (``imgs = fixed_imgs`` left from a check of the pipeline) trains on one batch.
- The inputs do not hold the answer: no column of a training batch's features equals the class
  targets of its loss (a label column left among the features makes the loss fall to 0 with
  nothing learnt that serves at prediction time).
- Data reaches the model at a scale it can learn from: inputs whose largest magnitude stays under
  1e-2 (images divided by 255 twice) give the first layer almost nothing to work with, unless a
  normalisation comes first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import dataloader

from torchkeel.diagnose.findings import Finding, site_fields
from torchkeel.diagnose.invariants._losses_arguments import REGRESSION
from torchkeel.diagnose.invariants.common import chained
from torchkeel.introspect.sites import tensors_in, user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

FAMILY = "batches"
_MAX_FETCHES = 256  # the first batches fetched are fingerprinted, and the data trained on after each
_MAX_VALUES = 4096  # values of a tensor in its fingerprint (evenly spaced)
_MIN_FETCHES = 5
_STALE_SHARE = 0.9  # fetches after which a model trained on the rows it trained on after the one before
_TINY = 1e-2  # the largest |value| of an input under this: almost nothing reaches the first layer
_TINY_CALLS = 64  # training calls whose input scale is read
_MIN_TINY_CALLS = 5
_LEAK_CHECKS = 64  # classification losses whose targets are looked for among the inputs' columns
_MIN_LEAK_ROWS = 16
_NORMS = (torch.nn.modules.batchnorm._NormBase, torch.nn.LayerNorm, torch.nn.GroupNorm)


def _input(args: Any) -> torch.Tensor | None:
    return next((t for t in tensors_in(args) if t.dim() >= 1 and not t.is_complex() and not t.is_meta), None)


class Listener:
    """Fingerprints the batches fetched and the data each model trains on after each fetch."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.fetches = 0
        self.fetched: dict[int, tuple[int, int]] = {}  # fetch → (fingerprint, rows) of the batch's input
        self.seen: dict[int, dict[int, int]] = {}  # fetch → fingerprint → rows of the data trained on after it
        self.where: dict[int, dict[str, Any]] = {}  # fingerprint → the model call that first trained on it
        self.tiny: dict[str, Any] = {"calls": 0, "tiny": 0, "max_abs": 0.0, "first": None}
        self.roots: dict[str, torch.nn.Module] = {}
        self.last_input: tuple[torch.Tensor, str] | None = None  # the latest 2-D data a model trained on
        self.leak: dict[str, Any] = {"checked": 0, "leaked": 0, "first": None}
        self.coeffs: dict[tuple[int, str], torch.Tensor] = {}

    def install(self) -> None:
        iterator = dataloader._BaseDataLoaderIter
        self.probe.patch(iterator, "__next__", self._noting_next(iterator.__next__))
        checks = self.probe.modules.loss_checks
        for func in REGRESSION:
            checks[func] = chained(checks.get(func), self.check_regression)

    def check_regression(self, func: Callable, args: Any, kwargs: dict) -> None:
        """A regression's targets, one value a row: the same leak check as class targets."""
        target = args[1] if len(args) > 1 else kwargs.get("target")
        if isinstance(target, torch.Tensor) and target.is_floating_point() and target.dim() >= 1:
            if target.numel() == target.shape[0]:
                self.on_loss_targets(target.reshape(-1))

    def _noting_next(self, original: Callable) -> Callable:
        listener, probe = self, self.probe

        def __next__(it: Any) -> Any:
            batch = original(it)
            probe.safely(listener._note_batch, batch)
            return batch

        return __next__

    def _note_batch(self, batch: Any) -> None:
        self.fetches += 1
        x = _input(batch)
        if x is not None and self.fetches <= _MAX_FETCHES:
            self.fetched[self.fetches] = (self.fingerprint(x), int(x.shape[0]))

    def fingerprint(self, x: torch.Tensor) -> int:
        """One integer for a tensor's values (equal tensors give equal integers)."""
        flat = x.detach().reshape(-1)
        if flat.numel() > _MAX_VALUES:
            flat = flat[torch.linspace(0, flat.numel() - 1, _MAX_VALUES, device=flat.device).long()]
        if flat.dtype == torch.bool:
            flat = flat.to(torch.uint8)
        bits = flat.contiguous().view(
            {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[flat.element_size()]
        )
        key = (bits.numel(), str(bits.device))
        if key not in self.coeffs:
            generator = torch.Generator().manual_seed(bits.numel())  # its own: the script's generators stay untouched
            self.coeffs[key] = torch.randint(1, 2**62, (bits.numel(),), generator=generator).mul_(2).add_(1)
        coeffs = self.coeffs[key].to(bits.device)
        return int((bits.to(torch.int64) * coeffs).sum()) ^ hash((tuple(x.shape), str(x.dtype)))

    def on_model_called(self, module: torch.nn.Module, args: Any) -> None:
        if isinstance(module, torch.nn.modules.loss._Loss) or next(module.parameters(), None) is None:
            return  # a loss module reads outputs, not data
        if not torch.is_grad_enabled() or not module.training:
            return  # evaluation
        x = _input(args)
        if x is None or x.grad_fn is not None or x.shape[0] < 1:
            return  # an output of another model (a GAN's fake images) is not data
        if 0 < self.fetches <= _MAX_FETCHES:
            fp = self.fingerprint(x)
            self.seen.setdefault(self.fetches, {})[fp] = int(x.shape[0])
            if fp not in self.where and len(self.where) < 4 * _MAX_FETCHES:
                self.where[fp] = {
                    "module": self.probe.name_of(module),
                    "step": self.probe.next_step,
                    **(user_site() or {}),
                }
        if x.is_floating_point() and self.tiny["calls"] < _TINY_CALLS:
            self._note_scale(module, x)
        if x.dim() == 2 and x.shape[1] >= 2 and self.leak["checked"] < _LEAK_CHECKS:
            self.last_input = (x, self.probe.name_of(module))

    def on_loss_targets(self, target: torch.Tensor) -> None:
        last, self.last_input = self.last_input, None
        if last is None or target.dim() != 1 or not torch.is_grad_enabled():
            return
        x, module = last
        if target.shape[0] != x.shape[0] or x.shape[0] < _MIN_LEAK_ROWS or target.unique().numel() < 2:
            return
        self.leak["checked"] += 1
        t = target.detach().to(x.device, x.dtype).unsqueeze(1)
        if target.is_floating_point():  # a regression's target copied into the features, to rounding
            same = torch.isclose(x.detach(), t, rtol=1e-5, atol=1e-6 * float(t.abs().max())).all(dim=0)
        else:
            same = (x.detach() == t).all(dim=0)
        if bool(same.any()):
            self.leak["leaked"] += 1
            if self.leak["first"] is None:
                column = int(same.nonzero()[0])
                step = self.probe.next_step
                self.leak["first"] = {"module": module, "column": column, "columns": int(x.shape[1]), "step": step}
                self.leak["first"].update(user_site() or {})

    def _note_scale(self, module: torch.nn.Module, x: torch.Tensor) -> None:
        largest = float(x.detach().abs().max())
        if largest != largest:  # NaN: another finding's business
            return
        tiny = self.tiny
        tiny["calls"] += 1
        if 0 < largest < _TINY:
            tiny["tiny"] += 1
            tiny["max_abs"] = max(tiny["max_abs"], largest)
            if tiny["first"] is None:
                name = self.probe.name_of(module)
                self.roots[name] = module
                tiny["first"] = {
                    "module": name,
                    "shape": list(x.shape),
                    "step": self.probe.next_step,
                    **(user_site() or {}),
                }

    def finish(self) -> None:
        first = self.tiny["first"]
        if first is not None:
            first["first_layer"] = self._first_layer(self.roots.get(first["module"]))
        self.probe.facts.invariants[FAMILY] = {"stale": self._stale(), "tiny": self.tiny, "leak": self.leak}

    def _first_layer(self, root: torch.nn.Module | None) -> str | None:
        """The class of the first layer with parameters that ran in ``root`` (a norm first rescales the input)."""
        if root is None:
            return None
        inside = {id(m) for m in root.modules()}
        layer = next((m for i, m in self.probe.state.leaf_order.items() if i in inside), None)
        return None if layer is None else ("norm:" if isinstance(layer, _NORMS) else "") + type(layer).__name__

    def _stale(self) -> dict[str, Any]:
        """Fetches of a new batch after which a model trained on rows it trained on after the fetch before."""
        compared, stale, example = 0, 0, None
        previous = None
        for i in sorted(self.seen):
            if previous is not None and i in self.fetched and previous in self.fetched:
                (fp, rows), (fp_before, _) = self.fetched[i], self.fetched[previous]
                if fp != fp_before:  # the loader handed out another batch
                    compared += 1
                    again = [f for f, n in self.seen[i].items() if f in self.seen[previous] and n == rows]
                    if again:
                        stale += 1
                        example = example or {**self.where.get(again[0], {}), "rows": rows, "fetch": i}
            previous = i
        return {"compared": compared, "stale": stale, "example": example}


def batch_repeats(facts: Any, outcome: object) -> list[Finding]:
    rec = facts.invariants.get(FAMILY, {}).get("stale")
    if not rec or rec["compared"] < _MIN_FETCHES or rec["stale"] < _STALE_SHARE * rec["compared"]:
        return []
    ex = rec["example"]
    message = (
        f"the DataLoader handed out a new batch {rec['compared']} times, and {rec['stale']} times {ex['module']} "
        f"trained on the same {ex['rows']} rows as after the batch before: the model trains on one batch, not on "
        "the ones the loader gives"
    )
    evidence = {
        "module": ex["module"],
        "rows": ex["rows"],
        "fetches_compared": rec["compared"],
        "fetches_stale": rec["stale"],
        "threshold": _STALE_SHARE,
        "step": ex.get("step"),
        **site_fields(ex),
    }
    fix = "train on the batch the loop fetches (a fixed batch kept from a pipeline check, or a variable reused)"
    return [Finding("invariant-batch-repeats", "warning", message, evidence, fix)]


def inputs_tiny(facts: Any, outcome: object) -> list[Finding]:
    tiny = facts.invariants.get(FAMILY, {}).get("tiny")
    if not tiny or tiny["calls"] < _MIN_TINY_CALLS or tiny["tiny"] < tiny["calls"]:
        return []
    first = tiny["first"]
    if (first.get("first_layer") or "").startswith("norm:"):
        return []  # a normalisation first brings the input to unit scale
    message = (
        f"every training input of {first['module']} (shape {first['shape']}) stayed under {_TINY:g} in magnitude "
        f"(at most {tiny['max_abs']:.3g}, {tiny['calls']} calls): data this close to zero gives the first layer "
        "almost no signal (a scaling applied twice, units that make every value tiny)"
    )
    evidence = {
        "module": first["module"],
        "shape": first["shape"],
        "max_abs": tiny["max_abs"],
        "threshold": _TINY,
        "calls": tiny["calls"],
        "first_layer": first.get("first_layer"),
        "step": first["step"],
        **site_fields(first),
    }
    fix = "scale the inputs once, to about unit scale (images / 255 once, then normalize; standardized features)"
    return [Finding("invariant-inputs-tiny", "warning", message, evidence, fix)]


def targets_in_inputs(facts: Any, outcome: object) -> list[Finding]:
    leak = facts.invariants.get(FAMILY, {}).get("leak")
    if not leak or leak["checked"] < _MIN_FETCHES or leak["leaked"] < _STALE_SHARE * leak["checked"]:
        return []
    first = leak["first"]
    message = (
        f"column {first['column']} of the {first['columns']} input features of {first['module']} equals the "
        f"targets of the loss in {leak['leaked']} of {leak['checked']} training batches: the answer is among the "
        "inputs, so the loss falls without the model learning anything it can use when the label is unknown"
    )
    evidence = {
        "module": first["module"],
        "column": first["column"],
        "columns": first["columns"],
        "batches_checked": leak["checked"],
        "batches_leaked": leak["leaked"],
        "step": first["step"],
        **site_fields(first),
    }
    fix = "drop the label (or anything computed from it) from the input features"
    return [Finding("invariant-targets-in-inputs", "warning", message, evidence, fix)]


IDS: tuple[str, ...] = ("invariant-batch-repeats", "invariant-targets-in-inputs", "invariant-inputs-tiny")
DETECTORS: tuple = (batch_repeats, targets_in_inputs, inputs_tiny)
EXPLAINED_BY: dict[str, set[str]] = {"invariant-inputs-tiny": {"nonfinite-input", "input-scale"}}
