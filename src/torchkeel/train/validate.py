"""Validation under ``model.eval()`` and ``torch.inference_mode()``, averaged over the whole set."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from torchkeel.data.loader import num_samples, to_device
from torchkeel.train.precision import Precision


def evaluate(
    model: torch.nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    device: torch.device,
    precision: Precision | None = None,
) -> dict[str, float]:
    """Mean loss (and accuracy, for class-index targets) over every sample of ``batches``.

    Batches are weighted by their size, so a short last batch counts for what it holds. Dropout
    and batch-norm updates are off during the pass; the model's previous mode is restored after.
    Returns ``{"val_loss": ..., "val_accuracy": ...}`` (accuracy only for classification:
    integer targets of shape ``[batch]`` and outputs of shape ``[batch, classes]``).
    The values are read back to the host once, at the end.
    """
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    count = 0
    is_classification = True
    try:
        with torch.inference_mode():
            for inputs, targets in batches:
                size = num_samples((inputs, targets))
                inputs = to_device(inputs, device)
                targets = to_device(targets, device)
                with (precision or Precision(device.type)).autocast():
                    outputs = model(inputs)
                    loss = loss_fn(outputs, targets)
                loss_sum += loss.double() * size
                count += size
                if is_classification and _is_class_index(outputs, targets):
                    correct += (outputs.argmax(dim=1) == targets).sum()
                else:
                    is_classification = False
    finally:
        model.train(was_training)
    if count == 0:
        return {}
    metrics = {"val_loss": loss_sum.item() / count}
    if is_classification:
        metrics["val_accuracy"] = correct.item() / count
    return metrics


def _is_class_index(outputs: Any, targets: Any) -> bool:
    return (
        isinstance(outputs, torch.Tensor)
        and isinstance(targets, torch.Tensor)
        and outputs.dim() == 2
        and targets.dim() == 1
        and not targets.is_floating_point()
    )
