"""Invariants: losses (see ``diagnose.invariants``).

What every healthy run's loss satisfies, whatever its fault:

- its arguments agree: input and target of an elementwise loss have the same shape (a target that
  only broadcasts, ``(N, 1)`` against ``(N,)``, makes an ``(N, N)`` loss of every pair); targets lie
  in the range the loss expects (soft cross-entropy targets are probabilities, ``kl_div`` takes
  log-probabilities and probabilities) and in the range the prediction can reach (a sigmoid's
  output fit to targets in ``[-1, 1]``); class targets are not the model's own integer input
  (a language model that forgot to shift its targets);
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

from torchkeel.diagnose.findings import Finding, site_fields
from torchkeel.introspect.sites import user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

FAMILY = "losses"

_CLASSES = (F.cross_entropy, F.nll_loss)
_BINARY = (F.binary_cross_entropy, F.binary_cross_entropy_with_logits)
_REGRESSION = (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss)
_ELEMENTWISE = _REGRESSION + _BINARY + (F.kl_div, F.poisson_nll_loss, F.soft_margin_loss)
_SAMPLED_FIRST = 30
_SAMPLE_EVERY = 5
_KEPT_SAMPLES = 400
# Graph nodes that only move a prediction's values around: the range of what they return is the
# range of what made their input.
_VIEWS = (
    "View",
    "Reshape",
    "Squeeze",
    "Unsqueeze",
    "Permute",
    "Transpose",
    "TBackward",
    "Slice",
    "Select",
    "Expand",
    "Clone",
    "Contiguous",
    "Flatten",
    "Cat",
    "Stack",
    "Index",
)
# The prediction's reachable range, by the last op that made it.
_RANGES = {
    "Sigmoid": (0.0, 1.0),
    "Tanh": (-1.0, 1.0),
    "Softmax": (0.0, 1.0),
    "Hardsigmoid": (0.0, 1.0),
    "Hardtanh": (-1.0, 1.0),
}
_UNREACHABLE_FRACTION = 0.05  # targets outside the prediction's range, beyond 1 % of the range


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

    def install(self) -> None:
        checks = self.probe.modules.loss_checks
        for func in _CLASSES + _ELEMENTWISE:
            checks[func] = _chained(checks.get(func), self.check)

    # ---------------------------------------------------------------- events
    def on_model_called(self, module: torch.nn.Module, args: Any) -> None:
        if next(module.parameters(), None) is not None:  # a model, not a loss module
            self._note_ints(args)
        if not torch.is_grad_enabled():
            self.no_grad_call = True

    def on_leaf_forward(self, module: torch.nn.Module, args: Any) -> None:
        if isinstance(module, torch.nn.Embedding):  # the ids of a model called with keywords
            self._note_ints(args)

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
        if func in _ELEMENTWISE and "invariant-loss-broadcast" not in self.found:
            self._broadcast(func, x, target)
        if "invariant-loss-target-range" not in self.found:
            self._target_range(func, bound, x, target)
        if not (torch.is_grad_enabled() and x.requires_grad):
            return  # an evaluation's loss: its arguments are checked, its value is not the training's
        calls = self.calls[func] = self.calls.get(func, 0) + 1
        if calls > _SAMPLED_FIRST and calls % _SAMPLE_EVERY:
            return
        where = user_site() or {}
        site = self.sites.setdefault(_key(func, where), _new_site(func, where))
        if (
            func in _CLASSES
            and not target.is_floating_point()
            and "invariant-loss-targets-are-inputs" not in self.found
        ):
            self._targets_are_inputs(func, bound, x, target, where)
        self._sample(site, func, bound, x, target)

    def _bind(self, func: Callable, args: Any, kwargs: dict) -> dict[str, Any]:
        sig = self.signatures.get(func)
        if sig is None:
            sig = self.signatures[func] = inspect.signature(func)
        try:
            return dict(sig.bind(*args, **kwargs).arguments)
        except TypeError:
            return {}

    def _record(self, finding_id: str, fields: dict[str, Any]) -> None:
        self.found.setdefault(finding_id, {"step": self.probe.next_step, **fields, **site_fields(user_site() or {})})

    def _broadcast(self, func: Callable, x: torch.Tensor, target: torch.Tensor) -> None:
        if x.shape == target.shape:
            return
        try:
            shape = torch.broadcast_shapes(x.shape, target.shape)
        except RuntimeError:
            return
        if math.prod(shape) > max(x.numel(), target.numel()):
            self._record(
                "invariant-loss-broadcast",
                {
                    "loss": func.__name__,
                    "input_shape": list(x.shape),
                    "target_shape": list(target.shape),
                    "broadcast_shape": list(shape),
                },
            )

    def _target_range(self, func: Callable, bound: dict[str, Any], x: torch.Tensor, target: torch.Tensor) -> None:
        why = None
        t = target.detach()
        if func is F.cross_entropy and t.is_floating_point() and t.shape == x.shape:
            low, high = float(t.min()), float(t.max())
            if low < -1e-4 or high > 1 + 1e-4:
                why = "soft cross-entropy targets must be class probabilities in [0, 1]"
        elif func is F.kl_div:
            log_target = bool(bound.get("log_target", False))
            low, high = float(t.min()), float(t.max())
            if float(x.detach().max()) > 1e-3:
                why, low, high = (
                    "kl_div's input must be log-probabilities (<= 0)",
                    float(x.detach().min()),
                    float(x.detach().max()),
                )
            elif not log_target and low < -1e-4:
                why = "kl_div's target must be probabilities (or pass log_target=True for log-probabilities)"
            elif log_target and high > 1e-3:
                why = "kl_div with log_target=True takes log-probabilities (<= 0) as its target"
        elif func is F.poisson_nll_loss and float(t.min()) < 0:
            why, low, high = "poisson_nll_loss's targets are counts (>= 0)", float(t.min()), float(t.max())
        elif func in _REGRESSION and t.is_floating_point() and t.numel() == x.numel():
            made_by = _made_by(x)
            bounds = _RANGES.get(made_by or "")
            if bounds is not None:
                lo, hi = bounds
                margin = 0.01 * (hi - lo)
                outside = float(((t < lo - margin) | (t > hi + margin)).float().mean())
                if outside >= _UNREACHABLE_FRACTION:
                    why = f"the prediction comes out of {made_by} (range [{lo:g}, {hi:g}]): these targets cannot be reached"
                    low, high = float(t.min()), float(t.max())
                    self._record(
                        "invariant-loss-target-range",
                        {
                            "loss": func.__name__,
                            "reason": why,
                            "made_by": made_by,
                            "target_min": low,
                            "target_max": high,
                            "fraction_outside": round(outside, 4),
                            "threshold": _UNREACHABLE_FRACTION,
                        },
                    )
                    return
        if why is not None:
            self._record(
                "invariant-loss-target-range",
                {"loss": func.__name__, "reason": why, "target_min": low, "target_max": high},
            )

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
                sites[key] = {k: site[k] for k in ("loss", "file", "line", "samples", "model_targets")}
                features = int(site["sum"].numel()) if site["sum"] is not None else 0
                sites[key].update(chance=chance, floor=floor, num_sampled=len(site["samples"]), features=features)
        self.probe.facts.invariants[FAMILY] = {"arguments": self.found, "sites": sites}


def _chained(earlier: Callable | None, check: Callable) -> Callable:
    """``check`` after the check the function already had (both run even if the first fails)."""
    if earlier is None:
        return check

    def both(func: Callable, args: Any, kwargs: dict) -> None:
        try:
            earlier(func, args, kwargs)
        finally:
            check(func, args, kwargs)

    return both


def _key(func: Callable, where: dict[str, Any]) -> str:
    return f"{func.__name__} at {where.get('file')}:{where.get('line')}"


def _new_site(func: Callable, where: dict[str, Any]) -> dict[str, Any]:
    kind = "classes" if func in _CLASSES else "binary" if func in _BINARY else "squared" if func is F.mse_loss else None
    return {
        "loss": func.__name__,
        "kind": kind,
        "calls": 0,
        "samples": [],
        "model_targets": 0,
        "file": where.get("file"),
        "line": where.get("line"),
        "sum": None,
        "sumsq": None,
        "rows": 0,
        "floor_sum": 0.0,
        "elements": 0,
    }


def _made_by(x: torch.Tensor) -> str | None:
    """The op that made ``x``, looking through views (``sigmoid(h).squeeze(1)`` is a sigmoid's)."""
    node = x.grad_fn
    for _ in range(8):
        if node is None:
            return None
        name = type(node).__name__
        if not name.startswith(_VIEWS) or not node.next_functions:
            return next((r for r in _RANGES if name.startswith(r)), None)
        node = node.next_functions[0][0]
    return None


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


def _chance(site: dict[str, Any]) -> tuple[float | None, float]:
    """(what the best constant prediction scores on the targets seen, the loss no prediction beats)."""
    total, rows = site["sum"], site["rows"]
    if total is None or rows < 2:
        return None, 0.0
    kind = site["kind"]
    if kind == "classes":
        p = total / total.sum()
        p = p[p > 0]
        return float(-(p * p.log()).sum()), site["floor_sum"] / rows
    if site.get("pooled"):
        return None, 0.0  # per-feature means unknown: no constant prediction to compare with
    mean = total / rows
    if kind == "binary":
        m = mean.clamp(1e-12, 1 - 1e-12)
        return float((-(m * m.log() + (1 - m) * (1 - m).log())).mean()), site["floor_sum"] / site["elements"]
    if site["sumsq"] is None:
        return None, 0.0
    var = (site["sumsq"] / rows - mean * mean).clamp_min(0)
    return float(var.mean()), 0.0


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
            "for kl_div), or drop the output's squashing (sigmoid/tanh) when the targets are not in its range.",
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
        "info",  # easy data falls as fast (a CNN on clean digit templates: 1 % of chance by step 35)
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
    "invariant-loss-broadcast",
    "invariant-loss-target-range",
    "invariant-loss-too-fast",
    "invariant-loss-at-chance",
)
DETECTORS: tuple = (targets_are_inputs, loss_broadcast, loss_target_range, loss_too_fast, loss_at_chance)
EXPLAINED_BY: dict[str, set[str]] = {
    "invariant-loss-target-range": {"label-out-of-range", "probabilities-into-cross-entropy"},
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
