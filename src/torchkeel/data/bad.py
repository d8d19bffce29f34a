"""The bad samples of an epoch and the batches they came with: one ledger per loader.

Both loaders keep one. A sample that fails to read, decode or transform is skipped and recorded
here (never replaced); each batch handed out is entered with the bad samples met while making
it. A consumer that reads ahead (the Trainer reads one group ahead) says how many of the latest
batches it has not trained on: their bad samples wait for the step that trains on them
(``take_new``), and a checkpoint taken before that step does not count them (``state_dict``),
so that a run resumed from it meets them again.

With several ranks the share is the job's: each rank takes its own new bad samples, shares them
(``add_others`` with every other rank's) and every rank decides with ``check()`` on the same
total, so that they all stop together instead of one rank raising while the others wait for it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torchkeel.errors import DataError

MAX_LISTED = 10
MAX_ENTRIES = 4096
"""Batches handed out whose entries are kept: far more than any consumer reads ahead."""


@dataclass
class Handout:
    """One batch as its loader handed it out."""

    bad: int
    """Bad samples met (and skipped) while making it."""
    origins: Any = None
    """Where its samples came from, in the loader's own terms (for error messages)."""
    undo: Any = None
    """What handing it out changed in the loader's position (a streaming loader's)."""


class BadSampleLedger:
    """The bad samples of the current epoch, out of ``num_samples`` (the whole job's epoch), and
    the batches of the epoch handed out so far, counted by ``handed``.

    With ``world_size`` > 1, ``record`` only counts: the caller shares the new ones
    (``take_new`` and ``add_others``) and calls ``check`` on every rank at the same point.
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
        """Met since they were last taken, ``(where, error)``, in the order met."""
        self.handed = 0
        """Batches handed out in this epoch (since ``epoch()`` began it or continued it)."""
        self._entries: deque[Handout] = deque(maxlen=MAX_ENTRIES)

    def start_epoch(self, epoch: int, *, resumed: bool = False) -> None:
        """A new pass over ``epoch``'s batches; ``resumed``: it continues the loaded state, which
        keeps the bad-sample count its checkpoint had."""
        if not resumed:
            self.count, self.others, self.listed = 0, 0, []
        self.epoch, self.handed = epoch, 0
        self._entries.clear()

    def record(self, bad: Sequence[tuple[str, str]]) -> None:
        """Count ``bad``; in one process raise ``DataError`` once the epoch has too many."""
        self.count += len(bad)
        self.listed = (self.listed + list(bad))[:MAX_LISTED]
        self.new += bad
        if not self.is_deferred:
            self.check()

    def hand_out(self, entry: Handout) -> None:
        """A batch is handed out, with the ``entry.bad`` bad samples recorded for it."""
        self._entries.append(entry)
        self.handed += 1

    def entry(self, number: int) -> Handout | None:
        """The entry of the epoch's batch ``number`` (0: the first handed out), if still kept."""
        index = number - (self.handed - len(self._entries))
        return self._entries[index] if 0 <= index < len(self._entries) else None

    def latest(self, read_ahead: int) -> list[Handout]:
        """The entries of the latest ``read_ahead`` batches handed out, oldest first."""
        if read_ahead <= 0:
            return []
        return list(self._entries)[-read_ahead:]

    def waiting(self, read_ahead: int) -> int:
        """Bad samples of the latest ``read_ahead`` batches, which are not trained on yet."""
        return sum(e.bad for e in self.latest(read_ahead))

    @property
    def has_new(self) -> bool:
        return bool(self.new)

    def take_new(self, read_ahead: int = 0) -> list[tuple[str, str]]:
        """The new bad samples of the batches trained on; those of the latest ``read_ahead``
        batches stay for the step that trains on them."""
        mine = self.new[: len(self.new) - self.waiting(read_ahead)]
        del self.new[: len(mine)]
        return mine

    def add_others(self, bad: Sequence[tuple[str, str]]) -> None:
        """Bad samples the other ranks met (every rank gets the same lists)."""
        self.others += len(bad)
        self.listed = (self.listed + list(bad))[:MAX_LISTED]

    def check(self, read_ahead: int = 0) -> None:
        """Raise ``DataError`` listing the first ten when the epoch holds more than the allowed
        share. The bad samples of the latest ``read_ahead`` batches, which the other ranks have
        not been told of yet, are left out, so that every rank counts the same."""
        total = self.count - self.waiting(read_ahead) + self.others
        if total > self.max_fraction * self.num_samples:
            listed = "; ".join(f"{where}: {error}" for where, error in self.listed)
            raise DataError(
                f"{total} bad samples in epoch {self.epoch}, more than data.max_bad_fraction="
                f"{self.max_fraction:g} of {self.num_samples:g} samples allows; first {len(self.listed)}: "
                f"{listed}. Fix or remove them, or raise data.max_bad_fraction"
            )

    def state_dict(self, read_ahead: int = 0) -> dict[str, Any]:
        """The epoch's count and first bad samples, without those of the latest ``read_ahead`` batches."""
        return {"num_bad": self.count - self.waiting(read_ahead), "bad_samples": [list(b) for b in self.listed]}

    def load_state_dict(self, states: Sequence[dict[str, Any]], rank: int = 0, world_size: int = 1) -> None:
        """Continue counting from the saved states of every rank. When the number of ranks
        changed, rank 0 takes over the whole count and the others know of it."""
        counts = [int(s.get("num_bad", 0)) for s in states]
        own = counts[rank] if len(states) == world_size else sum(counts) if rank == 0 else 0
        self.count, self.others = own, sum(counts) - own
        listed = [(str(w), str(e)) for s in states for w, e in s.get("bad_samples", [])]
        self.listed = list(dict.fromkeys(listed))[:MAX_LISTED]
