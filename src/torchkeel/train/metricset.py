"""Validation metrics from torchmetrics (or anything with ``update``/``compute``/``reset``).

``metrics:`` in the config names them; ``MetricSet`` builds them once, feeds every validation
batch's outputs and targets, and computes each once per validation. Under torchrun each rank
updates with its own share of the set and torchmetrics' ``compute()`` syncs the states across
ranks (its own all-gather), so every sample counts once, as in one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from torchkeel.config.imports import build_target
from torchkeel.errors import ConfigError


class StatefulMetric(Protocol):
    """What a metric must offer: torchmetrics' ``Metric`` API."""

    def update(self, preds: Any, target: Any) -> None: ...
    def compute(self) -> Any: ...
    def reset(self) -> None: ...


class MetricSet:
    """Named metrics updated batch by batch and read as ``{prefix + name: float}``.

    Example::

        metrics = MetricSet({"f1": MulticlassF1Score(num_classes=10)}, device)
        for x, y in loader:
            metrics.update(model(x), y)
        print(metrics.compute())   # {"val_f1": 0.87}
    """

    def __init__(self, metrics: dict[str, StatefulMetric], device: torch.device, prefix: str = "val_") -> None:
        self.metrics = {name: m.to(device) if hasattr(m, "to") else m for name, m in metrics.items()}
        self.prefix = prefix

    @classmethod
    def from_config(cls, entries: Sequence[Any], device: torch.device, on: str = "val") -> MetricSet | None:
        """One metric per ``metrics:`` entry (``name``, ``target``, ``args``) whose ``on`` lists
        ``on`` (``val`` or ``train``); None when there are none. Train metrics log as ``train_<name>``."""
        chosen = [(i, e) for i, e in enumerate(entries) if on in getattr(e, "on", ["val"])]
        if not chosen:
            return None
        built = {}
        for i, entry in chosen:
            metric = build_target(entry.target, entry.args, f"metrics[{i}]")
            if not all(callable(getattr(metric, attr, None)) for attr in ("update", "compute", "reset")):
                raise ConfigError(
                    f"metrics[{i}].target={entry.target!r} returned a {type(metric).__name__} without "
                    "update/compute/reset; use a torchmetrics Metric class"
                )
            built[entry.name] = metric
        return cls(built, device, prefix=f"{on}_")

    def update(self, outputs: Any, targets: Any) -> None:
        if outputs is None:  # a model that returns a tuple, or a step function that gave no logits
            raise ConfigError(
                f"metrics ({', '.join(self.metrics)}) score the model's predictions, and none were found: set "
                "loss.logits to where they are in what the model returns (an index or a key), or return "
                "torchkeel.StepOutput(loss, logits=..., targets=...) from loss.step_fn"
            )
        for metric in self.metrics.values():
            metric.update(outputs, targets)

    def compute(self) -> dict[str, float]:
        """Each metric's value over everything since the last reset, then reset (a host sync)."""
        values = {}
        for name, metric in self.metrics.items():
            value = metric.compute()
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ConfigError(
                        f"metric '{name}' computes a tensor of shape {tuple(value.shape)}; configure it "
                        "to return one number (e.g. average='macro')"
                    )
                value = value.item()
            values[self.prefix + name] = float(value)
            metric.reset()
        return values

    def reset(self) -> None:
        for metric in self.metrics.values():
            metric.reset()
