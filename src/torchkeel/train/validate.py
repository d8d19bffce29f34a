"""Validation under ``model.eval()`` and ``torch.inference_mode()``, averaged over the whole set
(or over its first ``max_batches`` batches)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any

import torch
import torch.distributed as dist

from torchkeel.batch import num_samples
from torchkeel.train.metricset import MetricSet
from torchkeel.train.objective import Objective
from torchkeel.train.precision import Precision

MAX_LOG_PERPLEXITY = 700.0
"""``exp`` of more overflows a float: a diverged model's perplexity is reported as ``exp(700)``."""


def evaluate(
    model: torch.nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[[Any, Any], torch.Tensor] | Objective,
    *,
    device: torch.device,
    precision: Precision | None = None,
    across_ranks: bool = False,
    metrics: MetricSet | None = None,
    max_batches: int | None = None,
) -> dict[str, float]:
    """Mean loss (and accuracy, for class-index targets) over every sample of ``batches``.

    Batches are weighted by their count (samples, or what the ``Objective`` counts), so a short
    last batch counts for what it holds. A step function's metrics come back as ``val_<name>``.
    Dropout and batch-norm updates are off during the pass; the model's previous mode is
    restored after. Returns ``{"val_loss": ..., "val_accuracy": ...}`` (accuracy only for
    classification: integer targets of shape ``[batch]`` and outputs of shape ``[batch, classes]``;
    ``val_perplexity``, ``exp(val_loss)``, for a causal or masked LM (the objective's ``token_loss``);
    a token mean with ``loss.count_key: labels``).
    The values are read back to the host once, at the end. ``across_ranks``: each rank saw its
    own share of the set; sums and counts are added over the ranks (one all-reduce), so the
    metrics are those of the whole set, as in one process. ``metrics``: a ``MetricSet`` fed each
    batch's outputs and targets (torchmetrics syncs its states across ranks itself); its values
    replace ``val_accuracy``. ``max_batches``: only the first N of ``batches`` (nanoGPT's
    ``eval_iters``, without its random draw: a loader in order gives the same N each time); the
    rest are not read.
    """
    objective = Objective.of(loss_fn)
    was_training = model.training
    model.eval()
    totals = _Totals(device)
    try:
        with torch.inference_mode():
            for batch in _first(batches, max_batches):
                with (precision or Precision(device.type)).autocast():
                    out = objective(model, batch, device)
                if num_samples(batch):  # an empty share is only there to keep the ranks in step
                    totals.add(out, objective, batch, metrics)
    finally:
        model.train(was_training)
    values, names = totals.read(across_ranks)  # host sync, once per validation
    total, samples = values[1], int(values[3])
    computed = metrics.compute() if metrics is not None else {}  # every rank: torchmetrics syncs here
    if total == 0:
        return {}
    result = {"val_loss": values[0] / total}
    if objective.token_loss:  # a causal or masked LM: its loss is a mean negative log-likelihood per token
        result["val_perplexity"] = math.exp(min(result["val_loss"], MAX_LOG_PERPLEXITY))
    result.update({f"val_{name}": value / total for name, value in zip(names, values[5:])})
    if values[4] == 0 and samples and metrics is None:
        result["val_accuracy"] = values[2] / samples
    result.update(computed)
    return result


def _first(batches: Iterable[Any], count: int | None) -> Iterator[Any]:
    """The first ``count`` of ``batches`` (``None``: all); a loader's iterator is closed after them."""
    source = iter(batches)
    try:
        yield from islice(source, count)
    finally:
        close = getattr(source, "close", None)
        if count is not None and close is not None:
            close()  # a generator stopped early: its workers and files go now, not when collected


class _Totals:
    """What a validation adds up over its batches, on the device until ``read``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.loss = torch.zeros((), dtype=torch.float64, device=device)
        self.metrics: dict[str, torch.Tensor] = {}
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.count: torch.Tensor | float = 0.0
        self.samples = 0
        self.is_classification = True

    def add(self, out: Any, objective: Objective, batch: Any, metrics: MetricSet | None) -> None:
        """One batch's loss, weighted by its count; its outputs to ``metrics`` or to the accuracy."""
        device = self.device
        weight = torch.as_tensor(out.count, device=device).double() if out.is_sum else objective.weight(batch)
        scale = 1.0 if out.is_sum else weight
        self.loss += out.loss.double() * scale
        for name, value in out.metrics.items():
            value = torch.as_tensor(value, device=device).double() * scale
            self.metrics[name] = self.metrics[name] + value if name in self.metrics else value
        self.count = self.count + weight
        if metrics is not None:
            metrics.update(out.outputs, out.targets)
        elif self.is_classification and _is_class_index(out.outputs, out.targets):
            self.correct += (out.outputs.argmax(dim=1) == out.targets).sum()
            self.samples += out.targets.shape[0]
        else:
            self.is_classification = False

    def read(self, across_ranks: bool) -> tuple[list[float], list[str]]:
        """``[loss, count, correct, samples, not classification, *metrics]`` (summed over the
        ranks with ``across_ranks``), and the metrics' names."""
        device, names = self.device, sorted(self.metrics)
        sums = torch.stack(
            [
                self.loss,
                torch.as_tensor(self.count, device=device).double(),
                self.correct.double(),
                torch.tensor(float(self.samples), device=device, dtype=torch.float64),
                torch.tensor(float(not self.is_classification), device=device, dtype=torch.float64),
                *[self.metrics[name].double() for name in names],
            ]
        )
        if across_ranks and dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums)
        return sums.tolist(), names


def _is_class_index(outputs: Any, targets: Any) -> bool:
    return (
        isinstance(outputs, torch.Tensor)
        and isinstance(targets, torch.Tensor)
        and outputs.dim() == 2
        and targets.dim() == 1
        and not targets.is_floating_point()
    )
