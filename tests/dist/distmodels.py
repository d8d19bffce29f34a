"""Models for the distributed tests: no dropout, so that 1 and 2 ranks compute the same thing."""

from __future__ import annotations

import os

from torch import nn


def mlp(num_features: int = 32, hidden: int = 64, num_classes: int = 4, dropout: float = 0.0) -> nn.Module:
    layers = [nn.Linear(num_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.Linear(hidden, num_classes))


class WithBadSamples:
    """The example's samples, with some that fail to load (a map-style dataset)."""

    def __init__(self, dataset, bad: tuple[int, ...]) -> None:
        self.dataset, self.bad = dataset, set(bad)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        if index in self.bad:
            raise OSError(f"record {index} is unreadable")
        return self.dataset[index]


def bad_data(bad: tuple[int, ...] = ()):
    from hand_written_loop import make_data

    train, val = make_data()
    return WithBadSamples(train, tuple(bad)), val


class FailsOnRank(nn.Module):
    """``mlp()`` that raises a user's error on ``rank`` before its ``at``-th training forward."""

    def __init__(self, rank: int = 1, at: int = 6) -> None:
        super().__init__()
        self.net, self.rank, self.at, self.forwards = mlp(), rank, at, 0

    def forward(self, x):
        if self.training:
            self.forwards += 1
            if self.forwards == self.at and int(os.environ.get("RANK", 0)) == self.rank:
                raise ValueError(f"a user's bug on rank {self.rank}")
        return self.net(x)


def normalized(num_features: int = 32, num_classes: int = 4) -> nn.Module:
    """A BatchNorm in front of a linear layer; ``momentum=None`` keeps the plain average of the
    batch means, so the running mean after an epoch is the mean of the rows the rank trained on."""
    return nn.Sequential(nn.BatchNorm1d(num_features, momentum=None), nn.Linear(num_features, num_classes))


def batch_normed(num_features: int = 32, hidden: int = 64, num_classes: int = 4) -> nn.Module:
    """``mlp()`` with a BatchNorm after each hidden linear layer: its output, and so its
    gradients, depend on the statistics of the batch it is given."""
    return nn.Sequential(
        nn.Linear(num_features, hidden),
        nn.BatchNorm1d(hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.BatchNorm1d(hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )
