"""What a constant prediction scores on the targets a loss was given (the losses family's chance level)."""

from __future__ import annotations

from typing import Any


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
