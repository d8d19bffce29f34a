"""A validation "metric" that returns a scripted sequence of values, one per compute()."""

from __future__ import annotations


class Scripted:
    def __init__(self, values: list[float]) -> None:
        self.values = list(values)
        self.calls = 0

    def to(self, device):
        return self

    def update(self, preds, target) -> None:
        pass

    def compute(self) -> float:
        value = self.values[min(self.calls, len(self.values) - 1)]
        self.calls += 1
        return value

    def reset(self) -> None:
        pass
