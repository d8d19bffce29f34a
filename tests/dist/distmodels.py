"""Models for the distributed tests: no dropout, so that 1 and 2 ranks compute the same thing."""

from __future__ import annotations

from torch import nn


def mlp(num_features: int = 32, hidden: int = 64, num_classes: int = 4, dropout: float = 0.0) -> nn.Module:
    layers = [nn.Linear(num_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.Linear(hidden, num_classes))
