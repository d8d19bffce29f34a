"""The rows family's checks of what a model reads (see ``diagnose.invariants.rows``): its output
depends on all of its input, and, when it attends, on the order of its input.

- Reach: the later half of every row along time (dim 1 of a ``(batch, time[, feature])`` input or of
  token ids) or an image's height (dim 2) replaced by the next row's must change some output; a model
  that reads ``out[:, 0]`` where ``out[:, -1]`` was meant does not.
- Order: a model with attention layers fed its input reversed along time must not return the same
  outputs (for one output a sequence) or the same outputs reversed (one a position): attention without
  positions treats a sequence as a set.
"""

from __future__ import annotations

from typing import Any

import torch

from torchkeel.diagnose.findings import Finding, site_fields

FAMILY = "rows"
_ATTENTION = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)


def _reach_dim(x: torch.Tensor) -> int:
    """The dim whose later half is replaced: time for (batch, time[, feature]), height for images."""
    return 1 if x.dim() <= 3 else 2


def _later_half(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` with the later half along ``_reach_dim`` taken from the next row (None: too short, or
    that half is the same in every row, padding)."""
    dim = _reach_dim(x)
    if x.dim() < 2 or x.shape[dim] < 4:
        return None
    half = x.shape[dim] // 2
    changed = x.detach().clone()
    later = changed.narrow(dim, half, x.shape[dim] - half)
    later.copy_(x.roll(1, 0).narrow(dim, half, x.shape[dim] - half))
    differs = (changed != x).reshape(x.shape[0], -1).any(1)
    return changed if int(differs.sum()) >= 2 else None


def _reversed(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` reversed along time (None: too short, or every row a palindrome of padding)."""
    if x.dim() < 2 or x.shape[1] < 4:
        return None
    flipped = x.detach().flip(1)
    return None if torch.equal(flipped, x) else flipped


def _attends(module: torch.nn.Module) -> bool:
    """The model has nn attention layers (a hand-written attention is not recognised: it is not checked)."""
    return any(isinstance(m, _ATTENTION) for m in module.modules())


def _reach(
    kind: str, x: torch.Tensor, out: torch.Tensor, base: torch.Tensor, scale: float, tolerance: float
) -> dict[str, Any]:
    """How many rows' outputs changed when the input was changed by ``kind`` ("reach": its later half
    replaced; "order": reversed, compared with the output reversed too when there is one a position)."""
    rows = x.shape[0]
    if kind == "order" and out.dim() >= 2 and out.shape[1] == x.shape[1]:
        out = out.flip(1)
    change = (out - base).abs().reshape(rows, -1).amax(dim=1) / scale
    return {"dim": 1 if kind == "order" or x.dim() <= 3 else 2, "rows_changed": int((change > tolerance).sum())}


def input_ignored(facts: Any, outcome: object) -> list[Finding]:
    """At every check of a model, its output stayed the same when the later half of each input row
    (along time, or the image's height) was replaced by another row's."""
    by_model: dict[str, list[dict[str, Any]]] = {}
    for check in facts.invariants.get(FAMILY, {}).get("checks", []):
        if check.get("reach") is not None:
            by_model.setdefault(check["model"], []).append(check)
    for model, done in by_model.items():
        if len(done) < 2 or any(c["reach"]["rows_changed"] for c in done):
            continue
        first = done[0]
        dim = first["reach"]["dim"]
        message = (
            f"{model}'s output does not depend on the later half of its input along dim {dim} (input shape "
            f"{first['input_shape']}): replacing it in every row with another row's changed no output at {len(done)} "
            "checks; the model reads only the start (output[:, 0] where output[:, -1] was meant, a slice or a "
            "truncation that drops the rest)"
        )
        evidence = {"model": model, "input_shape": first["input_shape"], "dim": dim, "checks": len(done)}
        evidence.update(step=first["step"], **site_fields(first))
        fix = "use the last time step (out[:, -1]) or a pooled summary of the sequence, and check what slices the input"
        return [Finding("invariant-input-ignored", "warning", message, evidence, fix)]
    return []


def order_ignored(facts: Any, outcome: object) -> list[Finding]:
    """A model with attention layers returned the same outputs for its input reversed along time."""
    by_model: dict[str, list[dict[str, Any]]] = {}
    for check in facts.invariants.get(FAMILY, {}).get("checks", []):
        if check.get("order") is not None:
            by_model.setdefault(check["model"], []).append(check)
    for model, done in by_model.items():
        if len(done) < 2 or any(c["order"]["rows_changed"] for c in done):
            continue
        first = done[0]
        message = (
            f"{model} attends but ignores the order of its input: reversing every sequence (input shape "
            f"{first['input_shape']}) left its outputs the same (reordered the same way, one a position) at "
            f"{len(done)} checks; attention without positions treats a sequence as a set"
        )
        evidence = {"model": model, "input_shape": first["input_shape"], "checks": len(done), "step": first["step"]}
        evidence.update(site_fields(first))
        fix = "add positional information to the inputs of the attention (positional embeddings or encodings)"
        return [Finding("invariant-order-ignored", "warning", message, evidence, fix)]
    return []
