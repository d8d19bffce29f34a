"""Bad samples of an epoch: counted, the first ten kept, and a stop past the allowed share.

Both loaders use it: a sample that fails to read, decode or transform is skipped and handed
here (never replaced); the Trainer drains ``new`` into incidents after each step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchkeel.errors import DataError

MAX_LISTED = 10
RECENT_BATCHES = 64  # batches whose sample origins are kept for error messages


class BadSamples:
    """The bad samples of the current epoch; ``limit`` is how many are allowed."""

    def __init__(self, max_fraction: float, num_samples: float) -> None:
        self.max_fraction, self.num_samples = max_fraction, num_samples
        self.epoch = 0
        self.count = 0
        self.listed: list[tuple[str, str]] = []
        self.new: list[tuple[str, str]] = []
        """Met since the caller last cleared this list, ``(where, error)``."""

    def start_epoch(self, epoch: int) -> None:
        self.epoch, self.count, self.listed = epoch, 0, []

    def record(self, bad: Sequence[tuple[str, str]]) -> None:
        """Count ``bad``; raise ``DataError`` listing the first ten once the epoch has too many."""
        self.count += len(bad)
        self.listed = (self.listed + list(bad))[:MAX_LISTED]
        self.new += bad
        if self.count > self.max_fraction * self.num_samples:
            listed = "; ".join(f"{where}: {error}" for where, error in self.listed)
            raise DataError(
                f"{self.count} bad samples in epoch {self.epoch}, more than data.max_bad_fraction="
                f"{self.max_fraction:g} of {self.num_samples:g} samples allows; first {len(self.listed)}: "
                f"{listed}. Fix or remove them, or raise data.max_bad_fraction"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"num_bad": self.count, "bad_samples": [list(b) for b in self.listed]}

    def load_state_dict(self, states: Sequence[dict[str, Any]]) -> None:
        """Continue counting from one state or several ranks' (summed)."""
        self.count = sum(int(s.get("num_bad", 0)) for s in states)
        self.listed = [(str(w), str(e)) for s in states for w, e in s.get("bad_samples", [])][:MAX_LISTED]


def remember(recent: dict[int, Any], batch: Any, origins: Any) -> None:
    """Keep the origins of a batch handed out, for the last ``RECENT_BATCHES`` batches."""
    recent[id(batch)] = origins
    while len(recent) > RECENT_BATCHES:
        del recent[next(iter(recent))]
