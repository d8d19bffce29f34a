"""The one place the order of a training step is written.

forward (autocast) → weighted backward per micro-batch (split further on out-of-memory) →
unscale → clip → non-finite guard → optimizer step → zero_grad → scheduler step.
The only host sync is the guard's, once per step, when ``check_finite`` is on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torchkeel.distributed.agree import read_finite
from torchkeel.distributed.parallel import GradSync
from torchkeel.train.clipping import clip_grad_norm
from torchkeel.train.hooks import TrainerHooks
from torchkeel.train.objective import Objective
from torchkeel.train.passes import clear_grads, forward_backward
from torchkeel.train.precision import Precision

__all__ = ["StepResult", "StepSettings", "clear_grads", "train_step"]


@dataclass
class StepResult:
    """What one optimizer step produced. Tensors stay on the device until someone reads them."""

    loss: torch.Tensor
    """Mean loss over the group's samples — or counted elements, see ``Objective`` (detached)."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping, of the unscaled gradients."""
    num_samples: int
    num_micro_batches: int
    num_tokens: int = 0
    """Token positions of the step's ``input_ids`` (the job's under torchrun; 0: not token batches)."""
    status: str = "ok"
    """``ok`` (applied), ``nonfinite`` (skipped: NaN/Inf loss or gradients), ``overflow``
    (fp16: the GradScaler skipped it and lowered its scale)."""
    loss_value: float | None = None
    """``loss`` read on the host, when the guard read it anyway (``check_finite``)."""
    grad_norm_value: float | None = None
    micro_batch_size: int | None = None
    """The micro-batch size that fit (``None``: whole loader batches)."""
    num_oom_splits: int = 0
    metrics: dict[str, torch.Tensor] | None = None
    """The step function's metrics, averaged over the group like the loss."""
    agreed: Any = field(default_factory=list)
    """``StepSettings.agree``'s flags, of the type ``agree()`` returned, each true when it was
    true on any rank."""


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    group: Sequence[Any],
    objective: Objective | Callable[[Any, Any], torch.Tensor],
    settings: StepSettings,
    micro_batch_size: int | None = None,
) -> StepResult:
    """One optimizer step over ``group``, a list of micro-batches, with ``settings`` (what every
    step of a run shares). ``micro_batch_size`` cuts the micro-batches to that size (a size that
    fit after an out-of-memory error, carried to the next step as ``StepResult.micro_batch_size``).

    ``objective`` is ``loss(output, target)`` for ``(input, target)`` batches, or an ``Objective``
    (a step function, batches of any shape, a count other than samples). Each piece's loss is
    weighted by its share of the group's count (samples by default), so the update equals a
    single step on the concatenated batch, including a short last group.

    Example, from a loop of your own::

        settings = StepSettings(params=list(model.parameters()), precision=Precision(), device=device)
        for group in iter_groups(loader.epoch(epoch), accumulate):
            result = train_step(model, optimizer, group, nn.functional.cross_entropy, settings)

    Raises:
        LabelOutOfRange: a label past the model's classes, naming its micro-batch and sample.
        torch.OutOfMemoryError: out of memory with ``settings.split_on_oom`` off.
    """
    if not group:
        raise ValueError("train_step needs at least one micro-batch")
    s = settings
    objective = objective if isinstance(objective, Objective) else Objective(objective)
    passes = forward_backward(model, optimizer, group, objective, s, micro_batch_size)
    s.precision.unscale_(optimizer)
    grad_norm = clip_grad_norm(s.params, s.clip_grad_norm_max)
    status, loss_value, norm_value = "ok", None, None
    if s.check_finite:
        # Host sync, the one per step: may this step be applied? Loss and norm come along.
        (loss_value, norm_value), (loss_ok, grads_ok) = read_finite((passes.loss, grad_norm), agreed=s.sync is not None)
        if not (loss_ok and grads_ok):
            status = "overflow" if loss_ok and s.precision.scaler is not None else "nonfinite"
    _apply(optimizer, s.precision, s.scheduler, status)
    if s.on_outputs is not None and status != "nonfinite":
        for outputs, targets in passes.outputs:
            s.on_outputs(outputs, targets)
    return StepResult(
        loss=passes.loss,
        grad_norm=grad_norm,
        num_samples=passes.num_samples,
        num_tokens=passes.num_tokens,
        num_micro_batches=len(group),
        status=status,
        loss_value=loss_value,
        grad_norm_value=norm_value,
        micro_batch_size=passes.micro_batch_size,
        num_oom_splits=passes.num_oom_splits,
        metrics=passes.metrics,
        agreed=passes.agreed,
    )


def _apply(
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    status: str,
) -> None:
    """Optimizer step (none for a non-finite step; the fp16 scaler skips an overflow itself),
    gradients cleared, the schedule advanced after an applied step."""
    if status == "nonfinite":
        precision.skip(optimizer)
    else:
        precision.step(optimizer)  # on "overflow" the scaler skips the update and lowers its scale
    clear_grads(optimizer)
    if scheduler is not None and status == "ok":
        scheduler.step()


@dataclass(frozen=True)
class StepSettings:
    """What every step of a run shares: ``train_step``'s settings, typed.

    ``params`` are the trainable parameters (measured and clipped to ``clip_grad_norm_max``);
    ``scheduler`` advances after each applied step. With ``check_finite``, a step whose loss or
    gradients are NaN/Inf is not applied: parameters, optimizer state and step counts stay as
    they were and the scheduler does not advance. With ``split_on_oom``, an out-of-memory error
    redoes the step in pieces of half the size; ``hooks.before_forward(num_samples)`` runs before
    each piece (fault injection in tests).

    Under torchrun, ``sync`` (a ``GradSync``) makes the step one of the whole job: the loss is
    weighted by global counts, gradients are reduced on the last micro-batch only, the returned
    loss and ``num_samples`` are the job's, and an out-of-memory error on any rank makes every
    rank redo the step with the smallest micro-batch size any rank needed.

    ``on_outputs(outputs, targets)`` is called once per piece of an applied step, after it
    (training metrics): an attempt redone after an out-of-memory error is not counted twice.

    ``agree()`` gives decisions every rank must take together (a stop signal, a save rank 0's
    clock wants), as a sequence of booleans (a ``NamedTuple`` names them). It is read once the
    forward and backward are done, and its flags ride along in the step's all-gather instead of
    a collective of their own; they come back OR-ed over the ranks in ``StepResult.agreed``, of
    the type ``agree()`` returned (as read, in one process).
    """

    params: Sequence[torch.nn.Parameter]
    precision: Precision
    device: torch.device
    clip_grad_norm_max: float | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    check_finite: bool = False
    split_on_oom: bool = False
    sync: GradSync | None = None
    on_outputs: Callable[[Any, Any], None] | None = None
    agree: Callable[[], Sequence[bool]] | None = None
    hooks: TrainerHooks | None = None
