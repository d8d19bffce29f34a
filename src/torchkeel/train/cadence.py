"""When the loop saves, logs, validates and ends.

``SaveCadence`` decides when to checkpoint: often enough to bound the work a crash loses, rarely
enough that saving stays a small share of the training time.

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

``LoopCadence`` decides, from the ``train`` and ``val`` sections, which steps log and validate and
where the run ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

from torchkeel.config.schema import TrainConfig, ValConfig


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


class StepPlan(NamedTuple):
    """What the loop does around one step, as ``LoopCadence.plan`` decided it."""

    is_last: bool
    """The run's last step (its last epoch's last step, or ``train.max_steps``)."""
    log: bool
    """A training row follows it (every ``train.log_every`` steps, and the last)."""
    validate: bool
    """A validation follows it (every ``val.every_steps`` steps)."""
    at_max_steps: bool
    """``train.max_steps`` is reached with it: the run stops, mid-epoch or not."""


class LoopCadence:
    """When the training loop logs, validates and ends, from the config's ``train`` and ``val`` sections.

    With ``val.every_steps`` 0 (and its old name ``train.val_every`` 0) the run validates at each
    epoch's end (``validates_at_epoch_end``); ``val.at_start`` adds one before the first step
    (``validates_at_start``), in a run that starts at step 0.
    """

    def __init__(self, train: TrainConfig, val: ValConfig | None = None) -> None:
        val = val or ValConfig()
        self.max_epochs, self.max_steps = train.max_epochs, train.max_steps
        self.log_every, self.val_every = train.log_every, val.every_steps or train.val_every
        self.at_start = val.at_start

    def validates_at_start(self, step: int) -> bool:
        """Whether to validate before step ``step + 1`` (``step`` steps done): at 0, with ``val.at_start``."""
        return self.at_start and step == 0

    @property
    def validates_at_epoch_end(self) -> bool:
        return not self.val_every

    def at_max_steps(self, step: int) -> bool:
        return self.max_steps is not None and step >= self.max_steps

    def wants_epoch(self, step: int, epoch: int) -> bool:
        """Whether the run goes on into epoch ``epoch`` (``step`` steps done)."""
        return not self.at_max_steps(step) and (self.max_epochs is None or epoch < self.max_epochs)

    def plan(self, step: int, epoch: int, last_of_epoch: bool) -> StepPlan:
        """The plan of step ``step`` (counted from 1) of ``epoch``; ``last_of_epoch``: its data ends with it."""
        at_max = self.max_steps is not None and step >= self.max_steps
        is_last = (last_of_epoch and epoch + 1 == self.max_epochs) or (
            self.max_steps is not None and step == self.max_steps
        )
        validate = bool(self.val_every) and step % self.val_every == 0
        return StepPlan(is_last, step % self.log_every == 0 or is_last, validate, at_max)
