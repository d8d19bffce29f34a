"""Rollback: the last good states in memory, and the way back to one after non-finite steps.

The non-finite guard answers ``ROLLBACK`` (``torchkeel.train.guards.NonFiniteGuard``); this
component carries it out. It keeps the two latest good states: a rollback returns to the older
one, since by the time a step goes non-finite the newer one may already be on the diverging
path. It is the Trainer's, and a hand-written loop's::

    rollback = Rollback(TrainingParts(model, optimizer, scheduler, scaler), every=200)
    rollback.take(0)
    ...
    if action is Action.ROLLBACK:
        to_step = rollback.restore(guard.lr_scale)
    elif action is Action.CONTINUE:
        rollback.after_step(step)
"""

from __future__ import annotations

from torchkeel.config.schema import GuardConfig
from torchkeel.train.counters import TrainingParts
from torchkeel.train.guards import Snapshot, apply_lr_scale


class Rollback:
    """Snapshots of ``parts`` every ``every`` applied steps; ``restore`` returns to the older of
    the two kept, with the learning rate scaled."""

    def __init__(self, parts: TrainingParts, every: int = 200) -> None:
        if every < 1:
            raise ValueError(f"Rollback(every=) must be >= 1, got {every}")
        self.parts, self.every = parts, every
        self.snapshots: list[Snapshot] = []
        self._initial_lrs = [group["lr"] for group in parts.optimizer.param_groups]  # without a scheduler

    @classmethod
    def from_config(cls, guard: GuardConfig, parts: TrainingParts) -> Rollback | None:
        """The rollback ``guard`` asks for (``guard.snapshot_every``); ``None`` when the guard is
        off or takes no snapshots."""
        return cls(parts, guard.snapshot_every) if guard.enabled and guard.snapshot_every else None

    @property
    def can_restore(self) -> bool:
        return bool(self.snapshots)

    def take(self, step: int) -> None:
        """Keep the state of ``step``. The older of the two kept goes, and its memory takes the copy."""
        p = self.parts
        reuse = self.snapshots[0] if len(self.snapshots) == 2 else None
        taken = Snapshot.take(step, reuse, model=p.model, optimizer=p.optimizer, scheduler=p.scheduler, scaler=p.scaler)
        self.snapshots = [*self.snapshots[-1:], taken]

    def after_step(self, step: int) -> None:
        """After an applied step (``step`` steps done): a snapshot every ``every`` steps."""
        if step % self.every == 0:
            self.take(step)

    def restore(self, lr_scale: float) -> int:
        """Return to the older kept state, its schedule scaled to ``lr_scale`` × the initial
        learning rates (``NonFiniteGuard.lr_scale``); returns that state's step."""
        if not self.snapshots:
            raise RuntimeError("Rollback.restore: no snapshot taken yet (call take() at the start)")
        del self.snapshots[1:]
        good, p = self.snapshots[0], self.parts
        good.restore(model=p.model, optimizer=p.optimizer, scheduler=p.scheduler, scaler=p.scaler)
        if p.scheduler is not None:
            apply_lr_scale(p.scheduler, p.optimizer, lr_scale)
        else:
            for group, initial in zip(p.optimizer.param_groups, self._initial_lrs):
                group["lr"] = initial * lr_scale
        return good.step
