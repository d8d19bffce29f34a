"""Non-finite guard: what to do after a step whose loss or gradients are NaN/Inf.

``NonFiniteGuard`` is a small state machine fed one verdict per step; it answers with an
action. Every rank feeds it the same agreed verdict (``train_step`` agrees it), so every rank
takes the same action. ``Snapshot`` is an in-memory good state a rollback returns to
(``torchkeel.train.rollback.Rollback`` keeps them).
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from torchkeel.checkpoint.format import snapshot
from torchkeel.config.schema import GuardConfig
from torchkeel.train.schedule import scale_schedule


class Action(enum.Enum):
    CONTINUE = "continue"
    SKIPPED = "skipped"
    ROLLBACK = "rollback"
    FAIL = "fail"


@dataclass
class NonFiniteGuard:
    """Policy ``skip`` | ``rollback`` | ``raise`` with escalation.

    ``skip``: the step was skipped (gradients dropped); after ``max_consecutive`` skips in a row,
    roll back. ``rollback``: roll back at the first non-finite step. Each rollback multiplies
    ``lr_scale`` by ``lr_backoff``; after ``max_rollbacks`` rollbacks, or at once with ``raise``,
    the answer is ``FAIL``.
    """

    policy: str = "skip"
    max_consecutive: int = 5
    lr_backoff: float = 0.5
    max_rollbacks: int = 3
    consecutive: int = 0
    num_skipped: int = 0
    num_rollbacks: int = 0
    lr_scale: float = 1.0

    @classmethod
    def from_config(cls, guard: GuardConfig) -> NonFiniteGuard:
        """The guard ``guard`` (the config's ``guard`` section) describes."""
        return cls(guard.on_nonfinite, guard.max_consecutive, guard.lr_backoff, guard.max_rollbacks)

    def observe(self, is_finite: bool, can_roll_back: bool = True) -> Action:
        """Record one step's verdict and return what the loop must do now."""
        if is_finite:
            self.consecutive = 0
            return Action.CONTINUE
        self.consecutive += 1
        self.num_skipped += 1
        if self.policy == "raise":
            return Action.FAIL
        if self.policy == "skip" and self.consecutive < self.max_consecutive:
            return Action.SKIPPED
        if self.num_rollbacks >= self.max_rollbacks or not can_roll_back:
            return Action.FAIL
        self.num_rollbacks += 1
        self.consecutive = 0
        self.lr_scale *= self.lr_backoff
        return Action.ROLLBACK

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("consecutive", "num_skipped", "num_rollbacks", "lr_scale")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


@dataclass
class Snapshot:
    """A copy of model, optimizer, scheduler and scaler state in CPU memory, taken at ``step``."""

    step: int
    states: dict[str, Any] = field(repr=False)

    @classmethod
    def take(cls, step: int, reuse: Snapshot | None = None, **objects: Any) -> Snapshot:
        """``Snapshot.take(step, model=m, optimizer=o, scheduler=s)``; ``None`` objects are skipped.
        ``reuse``: a snapshot nobody reads any more, whose memory the copy goes into."""
        states = {name: _state_of(obj) for name, obj in objects.items() if obj is not None}
        return cls(step, snapshot(states, reuse.states if reuse is not None else {}))  # one copy of all

    def restore(self, **objects: Any) -> None:
        for name, obj in objects.items():
            if obj is not None and name in self.states:
                obj.load_state_dict(copy.deepcopy(self.states[name]))


def _state_of(obj: Any) -> dict[str, Any]:
    """``obj.state_dict()``; a module's with its parameters as they are (the copy detaches them)."""
    return obj.state_dict(keep_vars=True) if isinstance(obj, torch.nn.Module) else obj.state_dict()


def apply_lr_scale(scheduler: Any, optimizer: torch.optim.Optimizer, scale: float) -> None:
    """Set every group's schedule to ``scale`` × its initial learning rate, from this step on.

    Works on a ``LambdaLR`` (the built-in schedule: its base rates are scaled and the current
    rates recomputed) and a ``TargetSchedule``, so the backoff survives a checkpoint through the
    scheduler's state.
    """
    scale_schedule(scheduler, optimizer, scale)


@dataclass
class SpikeDetector:
    """Flags a loss above ``factor`` × its running average (an exponential mean, after ``warmup`` steps)."""

    factor: float
    warmup: int = 20
    beta: float = 0.98
    average: float = 0.0
    count: int = 0

    @classmethod
    def from_config(cls, guard: GuardConfig) -> SpikeDetector | None:
        """The detector ``guard.spike_factor`` asks for (``None``: off)."""
        return cls(guard.spike_factor) if guard.spike_factor else None

    def observe(self, loss: float) -> float | None:
        """Feed a finite loss; return the running average it spiked above, else ``None``."""
        if not math.isfinite(loss):
            return None
        spiked = self.count >= self.warmup and loss > self.factor * self.average
        previous = self.average
        self.count += 1
        self.average = loss if self.count == 1 else self.beta * self.average + (1 - self.beta) * loss
        return previous if spiked else None

    def state_dict(self) -> dict[str, Any]:
        return {"average": self.average, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.average, self.count = state["average"], state["count"]
