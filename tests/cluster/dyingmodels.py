"""A user's model that dies once, as a worker does when the kernel's OOM killer or a node fault
takes it: SIGKILL, no handler runs. Configured through the model's own args, so it reaches
workers whatever launched them (Ray, torchrun, srun)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
from streamdata import Model


class DiesOnce(Model):
    """``streamdata.Model`` whose process is SIGKILLed before its ``at``-th forward on ``rank``,
    unless ``marker`` exists (it is created just before the kill)."""

    def __init__(self, marker: str, at: int, rank: int) -> None:
        super().__init__()
        self.marker, self.at, self.rank, self.forwards = Path(marker), at, rank, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.forwards += 1
            if self.forwards == self.at and int(os.environ.get("RANK", 0)) == self.rank and not self.marker.exists():
                self.marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)
