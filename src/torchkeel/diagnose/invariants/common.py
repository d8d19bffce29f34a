"""What the invariant families share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ANY = "*"
"""In ``EXPLAINED_BY``: any named error or warning explains this invariant finding."""

ANY_CAUSE = "**"
"""In ``EXPLAINED_BY``: any named error or warning, or any other invariant warning of a cause (not one
about how the loss moves), explains this invariant finding: its evidence is a loss that does not
fall, which any of them accounts for better."""

SYMPTOMS = frozenset({"invariant-loss-at-chance", "invariant-loss-too-fast"})
"""Invariant findings about how the loss moves: symptoms of most faults, never a cause of another."""


def chained(earlier: Callable | None, check: Callable) -> Callable:
    """``check`` after the check a function already has in the probe's function mode (another
    family's); both run even if the first fails."""
    if earlier is None:
        return check

    def both(func: Callable, args: Any, kwargs: dict) -> None:
        try:
            earlier(func, args, kwargs)
        finally:
            check(func, args, kwargs)

    return both
