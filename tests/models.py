"""Models for tests, importable by config ``model.target`` (``models:...``)."""

from __future__ import annotations

import torch
from torch import nn


class HardcodedBatch(nn.Module):
    """Reads the batch size as a Python int: a trace freezes it, so other batch sizes break."""

    def __init__(self, num_features: int = 32, num_classes: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(num_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = int(x.shape[0])
        return self.linear(x.reshape(batch, -1)) + torch.zeros(batch, 1)
