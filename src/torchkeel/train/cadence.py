"""When to checkpoint: often enough to bound the work a crash loses, rarely enough that saving
stays a small share of the training time.

Beyond the saves the caller always makes (``checkpoint.every_steps``, the last step, a stop
signal), a save is due

- at an epoch's end, once the training time since the last save is at least the last save's
  cost divided by ``max_overhead`` — so epoch-end saves never take more than that share of the
  run (a small dataset whose epochs take milliseconds is not checkpointed a hundred times);
- at any step, once that time is at least ``every_s`` seconds (and the same overhead bound).

A crash therefore loses at most ``max(every_s, save_cost / max_overhead)`` of work. The first
epoch end always saves: it is where the cost is first measured.

The decision reads this process's clock; under torchrun only rank 0's counts (the trainer
agrees it across ranks in the collective it already makes every step).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class SaveCadence:
    """Decides whether a time- or epoch-based checkpoint is due; told the cost of each save."""

    def __init__(
        self, every_s: float = 600.0, max_overhead: float = 0.02, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.every_s = every_s
        self.max_overhead = max_overhead
        self.clock = clock
        self.last_saved_at = clock()
        self.save_cost_s: float | None = None  # None until a save was measured

    def is_due(self, at_epoch_end: bool) -> bool:
        """Whether to save now (``at_epoch_end``: the loop finished an epoch)."""
        elapsed = self.clock() - self.last_saved_at
        if self.save_cost_s is None:
            return at_epoch_end or (self.every_s > 0 and elapsed >= self.every_s)
        affordable = elapsed * self.max_overhead >= self.save_cost_s
        if at_epoch_end and affordable:
            return True
        return self.every_s > 0 and elapsed >= self.every_s and affordable

    def saved(self, cost_s: float) -> None:
        """A checkpoint was just written; ``cost_s`` is how long the training loop waited for it."""
        self.save_cost_s = cost_s
        self.last_saved_at = self.clock()
