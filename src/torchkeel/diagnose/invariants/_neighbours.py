"""How often a row's nearest other row shares its label, against chance (the data family's label test)."""

from __future__ import annotations

import math
from typing import Any

import torch

_MIN_POOL_ROWS = 128


def _neighbour_agreement(pool: dict[str, Any]) -> dict[str, Any] | None:
    """How often a pooled row's nearest other row (Euclidean, in input space) has its label, against
    chance (the agreement of labels drawn independently of the inputs: the sum of squared class shares)."""
    labels = torch.tensor(pool["labels"])
    if len(labels) < _MIN_POOL_ROWS:
        return None
    rows = torch.cat(pool["rows"])
    distances = torch.cdist(rows, rows)
    distances.fill_diagonal_(float("inf"))
    nearest = distances.argmin(dim=1)
    agreement = float((labels[nearest] == labels).float().mean())
    shares = torch.unique(labels, return_counts=True)[1].float() / len(labels)
    chance = float((shares**2).sum())
    entropy = float(-(shares * shares.log()).sum())
    spread = math.sqrt(max(chance * (1 - chance), 1e-12) / len(labels))
    return {
        "rows": len(labels),
        "agreement": round(agreement, 4),
        "chance": round(chance, 4),
        "entropy": round(entropy, 4),
        "z": round((agreement - chance) / spread, 2),
        "site": pool["site"],
        **(pool["loader"] or {}),
    }
