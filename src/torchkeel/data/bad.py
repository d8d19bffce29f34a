"""Bad samples of an epoch: counted, the first ten kept, and a stop past the allowed share.

Both loaders use it: a sample that fails to read, decode or transform is skipped and handed
here (never replaced); the Trainer drains ``new`` into incidents after each step. With several
ranks the share is the job's: each rank counts its own, learns the others' (``add_others``,
from the Trainer's agreement) and every rank decides with ``check()`` on the same total, so
that they all stop together instead of one rank raising while the others wait for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchkeel.errors import DataError

MAX_LISTED = 10
RECENT_BATCHES = 64  # batches whose sample origins are kept for error messages


class BadSamples:
    """The bad samples of the current epoch, out of ``num_samples`` (the whole job's epoch).

    With ``world_size`` > 1, ``record`` only counts: the caller adds the other ranks' counts
    and calls ``check`` on every rank at the same point.
    """

    def __init__(self, max_fraction: float, num_samples: float, world_size: int = 1) -> None:
        self.max_fraction, self.num_samples = max_fraction, num_samples
        self.is_deferred = world_size > 1
        self.epoch = 0
        self.count = 0
        """This rank's bad samples this epoch."""
        self.others = 0
        """The other ranks' bad samples this epoch, as far as they were shared."""
        self.listed: list[tuple[str, str]] = []
        self.new: list[tuple[str, str]] = []
        """Met since the caller last cleared this list, ``(where, error)``."""

    def start_epoch(self, epoch: int) -> None:
        self.epoch, self.count, self.others, self.listed = epoch, 0, 0, []

    def record(self, bad: Sequence[tuple[str, str]]) -> None:
        """Count ``bad``; in one process raise ``DataError`` once the epoch has too many."""
        self.count += len(bad)
        self.listed = (self.listed + list(bad))[:MAX_LISTED]
        self.new += bad
        if not self.is_deferred:
            self.check()

    def add_others(self, bad: Sequence[tuple[str, str]]) -> None:
        """Bad samples the other ranks met (every rank gets the same lists)."""
        self.others += len(bad)
        self.listed = (self.listed + list(bad))[:MAX_LISTED]

    def check(self, waiting: int = 0) -> None:
        """Raise ``DataError`` listing the first ten when the epoch holds more than the allowed share.
        ``waiting``: this rank's bad samples in batches read ahead, which the other ranks have not
        been told of yet (left out, so that every rank counts the same)."""
        total = self.count - waiting + self.others
        if total > self.max_fraction * self.num_samples:
            listed = "; ".join(f"{where}: {error}" for where, error in self.listed)
            raise DataError(
                f"{total} bad samples in epoch {self.epoch}, more than data.max_bad_fraction="
                f"{self.max_fraction:g} of {self.num_samples:g} samples allows; first {len(self.listed)}: "
                f"{listed}. Fix or remove them, or raise data.max_bad_fraction"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"num_bad": self.count, "bad_samples": [list(b) for b in self.listed]}

    def load_state_dict(self, states: Sequence[dict[str, Any]], rank: int = 0, world_size: int = 1) -> None:
        """Continue counting from the saved states of every rank. When the number of ranks
        changed, rank 0 takes over the whole count and the others know of it."""
        counts = [int(s.get("num_bad", 0)) for s in states]
        own = counts[rank] if len(states) == world_size else sum(counts) if rank == 0 else 0
        self.count, self.others = own, sum(counts) - own
        listed = [(str(w), str(e)) for s in states for w, e in s.get("bad_samples", [])]
        self.listed = list(dict.fromkeys(listed))[:MAX_LISTED]


def remember(recent: dict[int, Any], batch: Any, origins: Any) -> None:
    """Keep the origins of a batch handed out, for the last ``RECENT_BATCHES`` batches."""
    recent[id(batch)] = origins
    while len(recent) > RECENT_BATCHES:
        del recent[next(iter(recent))]
