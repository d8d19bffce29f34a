"""The one place the order of a training step is written.

forward (autocast) → weighted backward per micro-batch → unscale → clip → optimizer step →
zero_grad → scheduler step. Nothing here reads a value back to the host: the loss and the
gradient norm are returned as device tensors for the caller to read when it logs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torchkeel.data.loader import num_samples, to_device
from torchkeel.train.clipping import clip_grad_norm
from torchkeel.train.precision import Precision


@dataclass
class StepResult:
    """What one optimizer step produced; tensors stay on the device until someone logs them."""

    loss: torch.Tensor
    """Mean loss over the group's samples (detached)."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping, of the unscaled gradients."""
    num_samples: int
    num_micro_batches: int


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    group: Sequence[Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    params: Sequence[torch.nn.Parameter],
    precision: Precision,
    device: torch.device,
    clip_grad_norm_max: float | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> StepResult:
    """One optimizer step over ``group``, a list of ``(input, target)`` micro-batches.

    Each micro-batch's loss is weighted by its share of the group's samples, so the update
    equals a single step on the concatenated batch, including a short last group.
    ``params`` are the trainable parameters (measured and clipped).
    """
    if not group:
        raise ValueError("train_step needs at least one micro-batch")
    sizes = [num_samples(batch) for batch in group]
    total = sum(sizes)
    non_blocking = device.type == "cuda"
    loss_sum: torch.Tensor | None = None
    for (inputs, targets), size in zip(group, sizes):
        inputs = to_device(inputs, device, non_blocking)
        targets = to_device(targets, device, non_blocking)
        with precision.autocast():
            loss = loss_fn(model(inputs), targets)
        if size != total:
            loss = loss * (size / total)
        precision.backward(loss)
        detached = loss.detach().float()
        loss_sum = detached if loss_sum is None else loss_sum + detached
    precision.unscale_(optimizer)
    grad_norm = clip_grad_norm(params, clip_grad_norm_max)
    precision.step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    return StepResult(
        loss=loss_sum,  # type: ignore[arg-type]  # the group is not empty
        grad_norm=grad_norm,
        num_samples=total,
        num_micro_batches=len(group),
    )
