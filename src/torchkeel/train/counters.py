"""Where a run stands (the counters a checkpoint carries, so that a resumed run continues with the
very next batch) and the objects that learn."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import torch


@dataclass
class RunCounters:
    """Steps, epochs and samples done, and what the run decided along the way.

    ``batch_in_epoch`` counts loader batches (not steps) into the current epoch; ``validated_at``
    and ``saved_at`` are the steps of the last validation and checkpoint (-1: none yet);
    ``micro_batch_size`` is the size an out-of-memory split left (``None``: whole batches).
    """

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    samples: int = 0
    tokens: int = 0
    val_metrics: dict[str, float] = field(default_factory=dict)
    validated_at: int = -1
    saved_at: int = -1
    micro_batch_size: int | None = None

    def state_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def position(self) -> dict[str, int]:
        """Where the run stands: steps, epochs and samples done, and loader batches into the epoch."""
        return {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "samples": self.samples}

    def totals(self) -> dict[str, Any]:
        """The summary's share: the last validation's metrics, and steps, epochs and samples done."""
        return {**self.val_metrics, "steps": self.step, "epochs": self.epoch, "samples": self.samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every counter from ``state``; one a checkpoint lacks keeps its start value."""
        for f in fields(self):
            if f.name in state:
                setattr(self, f.name, state[f.name])


@dataclass
class TrainingParts:
    """What a checkpoint captures besides the run's counters: the objects that learn."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any
    ema: Any = None


class Agreed(NamedTuple):
    """What every rank decides together after a step, agreed in the step's own all-gather
    (``StepSettings(agree=)``): each flag is true when it was true on any rank."""

    stop: bool = False
    """A stop signal (SIGTERM, SIGINT, a Slurm warning) arrived."""
    save_due: bool = False
    """Rank 0's clock wants a save (``checkpoint.every_s``)."""
    bad_samples: bool = False
    """Some rank met bad samples since they were last shared."""
