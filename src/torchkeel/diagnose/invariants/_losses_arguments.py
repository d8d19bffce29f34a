"""The losses family's argument checks: pure functions of one loss call's arguments, each returning
the evidence of a broken invariant or None (see ``diagnose.invariants.losses``).

- Shapes agree without broadcasting.
- Targets lie in the range the loss expects (soft cross-entropy targets are probabilities,
  ``kl_div`` and ``nll_loss`` take log-probabilities, counts are ≥ 0) and label smoothing leaves the
  targets most of their information.
- The prediction can reach its targets: the op that made it (looking through views) bounds its range
  (a ReLU's output fit to negative targets, a softmax's rows that sum to 1 fit to multi-hot targets),
  and logits squashed into a bounded range give cross entropy a floor near chance.
- Class targets are not the padding id the model's embedding declares, unless the loss ignores it.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

import torch
import torch.nn.functional as F

CLASSES = (F.cross_entropy, F.nll_loss)
BINARY = (F.binary_cross_entropy, F.binary_cross_entropy_with_logits)
REGRESSION = (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss)
ELEMENTWISE = REGRESSION + BINARY + (F.kl_div, F.poisson_nll_loss, F.soft_margin_loss)
# Graph nodes that only move a prediction's values around: the range of what they return is the
# range of what made their input.
VIEWS = (
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
# The prediction's reachable range, by the last op that made it (its grad_fn's name, "Backward" and
# its number dropped).
_INF = math.inf
RANGES = {
    "Sigmoid": (0.0, 1.0),
    "Tanh": (-1.0, 1.0),
    "Softmax": (0.0, 1.0),
    "Hardsigmoid": (0.0, 1.0),
    "Hardtanh": (-1.0, 1.0),
    "Relu": (0.0, _INF),
    "Softplus": (0.0, _INF),
    "Exp": (0.0, _INF),
    "Abs": (0.0, _INF),
}
_BOUNDED = {k for k, (lo, hi) in RANGES.items() if hi < _INF}
_LOGITS = (F.cross_entropy, F.binary_cross_entropy_with_logits)
_LOGIT_FLOOR = 0.2  # a bounded logit's loss floor, as a fraction of chance: beyond it no model can fit
_UNREACHABLE_FRACTION = 0.05  # targets outside the prediction's range, beyond 1 % of the range
_LOG_PROB_SUM = 1e-2  # |logsumexp| of a row of log-probabilities (nll_loss's input) is at most this
_MAX_SMOOTHING = 0.5  # label smoothing above this leaves the true class under half its mass
_MULTI_HOT = 1.5  # targets whose rows sum to more than this are multi-hot (several labels a row)
_PADDING_SHARE = 0.1  # class targets equal to the embedding's padding id, as a share of the targets


def made_by(x: torch.Tensor) -> str | None:
    """The range-bounding op that made ``x``, looking through views (``sigmoid(h).squeeze(1)``)."""
    node = x.grad_fn
    for _ in range(8):
        if node is None:
            return None
        name = type(node).__name__
        if not name.startswith(VIEWS) or not node.next_functions:
            op = re.sub(r"Backward\d*$", "", name)
            return op if op in RANGES else None
        node = node.next_functions[0][0]
    return None


def broadcast(func: Callable, x: torch.Tensor, target: torch.Tensor) -> dict[str, Any] | None:
    if x.shape == target.shape:
        return None
    try:
        shape = torch.broadcast_shapes(x.shape, target.shape)
    except RuntimeError:
        return None
    if math.prod(shape) <= max(x.numel(), target.numel()):
        return None
    return {
        "loss": func.__name__,
        "input_shape": list(x.shape),
        "target_shape": list(target.shape),
        "broadcast_shape": list(shape),
    }


def target_range(func: Callable, bound: dict[str, Any], x: torch.Tensor, t: torch.Tensor) -> dict[str, Any] | None:
    """The first way the call's arguments leave the range the loss works in, or None."""
    for check in (_bounded_logits, _expected_range, _unreachable, _smoothing):
        found = check(func, bound, x, t)
        if found is not None:
            return {"loss": func.__name__, **found}
    return None


def _expected_range(func: Callable, bound: dict[str, Any], x: torch.Tensor, t: torch.Tensor) -> dict[str, Any] | None:
    low, high = (float(t.min()), float(t.max())) if t.numel() else (0.0, 0.0)
    why = None
    if func is F.cross_entropy and t.is_floating_point() and t.shape == x.shape:
        if low < -1e-4 or high > 1 + 1e-4:
            why = "soft cross-entropy targets must be class probabilities in [0, 1]"
    elif func is F.kl_div:
        log_target = bool(bound.get("log_target", False))
        if float(x.detach().max()) > 1e-3:
            why, low, high = "kl_div's input must be log-probabilities (<= 0)", float(x.min()), float(x.max())
        elif not log_target and low < -1e-4:
            why = "kl_div's target must be probabilities (or pass log_target=True for log-probabilities)"
        elif log_target and high > 1e-3:
            why = "kl_div with log_target=True takes log-probabilities (<= 0) as its target"
    elif func in BINARY and t.is_floating_point() and (low < -1e-4 or high > 1 + 1e-4):
        why = f"{func.__name__}'s targets are probabilities in [0, 1] (labels coded -1/+1 or as class ids?)"
    elif func is F.poisson_nll_loss and low < 0:
        why = "poisson_nll_loss's targets are counts (>= 0)"
    elif func is F.nll_loss and x.dim() >= 2 and x.is_floating_point():
        total = float(torch.logsumexp(x.detach().movedim(1, -1).reshape(-1, x.shape[1]).float(), dim=1).abs().max())
        if total > _LOG_PROB_SUM:
            why, low, high = (
                f"nll_loss's input must be log-probabilities (log_softmax: each row's logsumexp is 0; here up to "
                f"{total:.3g}): raw scores let the loss fall without bound",
                float(x.detach().min()),
                float(x.detach().max()),
            )
    if why is None:
        return None
    return {"reason": why, "target_min": low, "target_max": high}


def _unreachable(func: Callable, bound: dict[str, Any], x: torch.Tensor, t: torch.Tensor) -> dict[str, Any] | None:
    """A prediction made by an op whose range leaves out many of its targets (a ReLU's output fit to
    targets that are negative half the time; a softmax's rows fit to rows of several labels)."""
    if func not in REGRESSION + (F.binary_cross_entropy,) or not t.is_floating_point() or t.numel() != x.numel():
        return None
    op = made_by(x)
    if op is None:
        return None
    low, high = float(t.min()), float(t.max())
    if op == "Softmax" and x.dim() >= 2 and t.shape == x.shape:
        sums = t.detach().reshape(-1, x.shape[-1]).sum(-1)
        share = float((sums > _MULTI_HOT).float().mean())
        if share >= _UNREACHABLE_FRACTION:
            return {
                "reason": f"the prediction comes out of a softmax (each row sums to 1) while {share:.0%} of the target "
                "rows hold several labels (rows sum to more than 1): they cannot be reached",
                "made_by": op,
                "target_min": low,
                "target_max": high,
                "fraction_outside": round(share, 4),
                "threshold": _UNREACHABLE_FRACTION,
            }
    lo, hi = RANGES[op]
    margin = 0.01 * ((hi - lo) if hi < _INF else max(high - low, 1e-12))
    outside = float(((t < lo - margin) | (t > hi + margin)).float().mean())
    if outside < _UNREACHABLE_FRACTION:
        return None
    return {
        "reason": f"the prediction comes out of {op} (range [{lo:g}, {hi:g}]): {outside:.0%} of the targets cannot be reached",
        "made_by": op,
        "target_min": low,
        "target_max": high,
        "fraction_outside": round(outside, 4),
        "threshold": _UNREACHABLE_FRACTION,
    }


def _bounded_logits(func: Callable, bound: dict[str, Any], x: torch.Tensor, t: torch.Tensor) -> dict[str, Any] | None:
    """Logits squashed into a bounded range (a sigmoid before cross entropy): however right the model
    is, the loss cannot fall below a floor near chance level."""
    if func not in _LOGITS or x.dim() < 1:
        return None
    op = made_by(x)
    if op not in _BOUNDED:
        return None
    lo, hi = RANGES[op]
    if func is F.cross_entropy:
        classes = int(x.shape[1] if x.dim() >= 2 else x.shape[0])
        if classes < 2:
            return None
        floor, chance = math.log1p((classes - 1) * math.exp(lo - hi)), math.log(classes)
    else:  # with logits: a 0 target's loss is at least softplus(lo), a 1 target's softplus(-hi)
        floor, chance = max(math.log1p(math.exp(lo)), math.log1p(math.exp(-hi))), math.log(2)
    if floor < _LOGIT_FLOOR * chance:
        return None
    return {
        "reason": f"its logits come out of {op} (range [{lo:g}, {hi:g}]): the loss cannot fall below {floor:.3g} "
        f"(chance level {chance:.3g}) however right the model is",
        "made_by": op,
        "loss_floor": round(floor, 6),
        "chance": round(chance, 6),
        "target_min": float(t.min()),
        "target_max": float(t.max()),
    }


def _smoothing(func: Callable, bound: dict[str, Any], x: torch.Tensor, t: torch.Tensor) -> dict[str, Any] | None:
    smoothing = bound.get("label_smoothing", 0.0)
    if func is not F.cross_entropy or not isinstance(smoothing, (int, float)) or smoothing <= _MAX_SMOOTHING:
        return None
    return {
        "reason": f"label_smoothing={smoothing:g} moves {smoothing:.0%} of each target's mass off its class: the "
        "targets say little about which class is right (0.1 is usual)",
        "label_smoothing": float(smoothing),
        "target_min": float(t.min()),
        "target_max": float(t.max()),
    }


def counts_padding(bound: dict[str, Any], t: torch.Tensor, padding_ids: set[int]) -> dict[str, Any] | None:
    """Class targets that are, in a large share, the padding id a model's embedding declares, while the
    loss does not ignore it: the model learns to predict padding."""
    ignore = bound.get("ignore_index", -100)
    for pad in sorted(padding_ids):
        if pad == ignore:
            continue
        share = float((t == pad).float().mean())
        if share >= _PADDING_SHARE:
            return {"padding_idx": pad, "ignore_index": ignore, "padding_share": round(share, 4), "targets": t.numel()}
    return None


def negated_loss(root: torch.Tensor) -> str | None:
    """The loss function under a minus sign at the root of the backward (``-criterion(out, y)``): the
    optimizer climbs the loss. Returns the loss op's name."""
    node = root.grad_fn
    if node is None or not type(node).__name__.startswith("NegBackward") or not node.next_functions:
        return None
    inner = node.next_functions[0][0]
    name = re.sub(r"Backward\d*$", "", type(inner).__name__) if inner is not None else ""
    return name if name in _LOSS_OPS else None


_LOSS_OPS = {
    "NllLoss",
    "NllLoss2D",
    "MseLoss",
    "BinaryCrossEntropy",
    "BinaryCrossEntropyWithLogits",
    "SmoothL1Loss",
    "HuberLoss",
    "KlDiv",
    "L1Loss",
    "SoftMarginLoss",
    "MultiMarginLoss",
    "MultilabelMarginLoss",
}


def ignores_a_class(bound: dict[str, Any], x: torch.Tensor, t: torch.Tensor) -> dict[str, Any] | None:
    """One class target a sample, and the loss's ``ignore_index`` is one of the classes, held by a
    large share of them: those samples carry no loss (``ignore_index=0`` meant for padding, on labels)."""
    ignore = bound.get("ignore_index", -100)
    if not isinstance(ignore, int) or x.dim() != 2 or not 0 <= ignore < x.shape[1]:
        return None
    share = float((t == ignore).float().mean())
    if share < _PADDING_SHARE / 2:
        return None
    return {
        "reason": f"ignore_index={ignore} is one of the {x.shape[1]} classes: {share:.0%} of the targets (class "
        f"{ignore}) carry no loss, and the model never learns that class",
        "ignore_index": ignore,
        "ignored_share": round(share, 4),
        "target_min": float(t.min()),
        "target_max": float(t.max()),
    }
