"""The forward and backward passes of one step's micro-batches, each loss weighted by its share.

``forward_backward`` is the one place a micro-batch's forward and backward are written, and
``train_step`` (``torchkeel.train.step``) calls it once per step. It runs the group's pieces in
order: each micro-batch whole, or cut to ``micro_batch_size``. After an out-of-memory error
(with ``split_on_oom``) it drops the gradients and runs them again in pieces of half the size,
until they fit. Under torchrun every rank finishes each attempt (a rank that ran out of memory
runs empty pieces, so that no rank waits on it) and the ranks agree in one all-gather
(``_settle``) on the job's loss and counts, the flags of ``agree()``, and whether they all redo
the step. How a piece's loss is weighted is written once, in ``weighted_loss``; a step
function's summed losses are divided by their count once it is known (``divide_grads``).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from torchkeel.batch import num_samples, num_tokens, split_batch
from torchkeel.distributed.parallel import GradSync, empty_like_batch
from torchkeel.errors import ConfigError, SampleTooLarge
from torchkeel.train.objective import LabelOutOfRange, Objective
from torchkeel.train.oom import free_memory, smaller_size

if TYPE_CHECKING:
    from torchkeel.train.step import StepSettings

_NOTHING = nullcontext()
_TORCH_ZERO_GRAD = torch.optim.Optimizer.zero_grad


def clear_grads(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)``. An optimizer that keeps torch's own ``zero_grad``
    has its gradients set to ``None`` here directly: the same result without the profiler range
    torch opens on every call, which costs more than the clearing itself (about 7 us a step on a
    CPU). Under a running profiler, or with a ``zero_grad`` of its own, the optimizer's is called."""
    if (
        type(optimizer).zero_grad is not _TORCH_ZERO_GRAD
        or "zero_grad" in vars(optimizer)
        or torch.autograd._profiler_enabled()
    ):
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


@dataclass
class Passes:
    """What the forward and backward passes of one step came to."""

    loss: torch.Tensor
    """The mean loss over the group (the job's under torchrun), detached."""
    metrics: dict[str, torch.Tensor] | None
    micro_batch_size: int | None
    """The micro-batch size that fit (``None``: whole micro-batches)."""
    agreed: Any
    """``agree()``'s flags, each OR-ed over the ranks (as read, in one process)."""
    num_samples: int
    num_tokens: int
    num_oom_splits: int = 0
    outputs: list[tuple[Any, Any]] = field(default_factory=list)
    """``(outputs, targets)`` of each piece with samples (kept only when ``on_outputs`` is set)."""


def forward_backward(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    group: Sequence[Any],
    objective: Objective,
    settings: StepSettings,
    micro_batch_size: int | None = None,
) -> Passes:
    """Forward and weighted backward of every piece of ``group`` (``weighted_loss``), redone in
    smaller pieces after an out-of-memory error, until they fit (``optimizer`` clears the failed
    attempt's gradients); ``hooks.before_forward(num_samples)`` runs before each piece's forward.

    Raises:
        LabelOutOfRange: naming the micro-batch and the sample in it.
        torch.OutOfMemoryError: with ``split_on_oom`` off.
        SampleTooLarge: under torchrun, a piece of one sample does not fit on some rank.
    """
    s, sync = settings, settings.sync
    sizes = list(map(num_samples, group))
    weights = list(map(objective.weight, group)) if objective.count_key else list(map(float, sizes))
    total = sum(weights) if sync is None else sync.nominal
    before_forward = s.hooks.before_forward if s.hooks is not None else None
    non_blocking, num_splits, failed = s.device.type == "cuda", 0, False
    while True:
        pieces = _pieces(group, sizes, weights, objective, micro_batch_size, sync, empty=failed)
        running, autocast, last = _Running(s.device, s.on_outputs is not None), s.precision.autocast(), len(pieces) - 1
        try:
            for number, (piece, n, share, index, offset) in enumerate(pieces):
                if before_forward is not None and n:
                    before_forward(n)
                with sync.micro_batch(number == last) if sync is not None else _NOTHING:
                    try:
                        with autocast:  # entered once per piece
                            out = objective(model, piece, s.device, non_blocking)
                    except LabelOutOfRange as exc:
                        exc.micro_batch, exc.sample = index, exc.sample + offset
                        raise
                    loss = weighted_loss(out.loss, out.is_sum, share, total, sync is not None)
                    s.precision.backward(loss)
                if n:
                    running.add(out, loss, share, total, sync)
            oom = False
        except torch.OutOfMemoryError:
            if failed or (sync is None and not s.split_on_oom):
                raise
            oom = True
        if oom:  # out of the except block, so that the failed attempt's frames and tensors can be freed
            running = out = loss = None  # its outputs, and the graph a failed backward holds
            if sync is None:
                clear_grads(optimizer)
            free_memory(s.device)
            if sync is not None:  # finish the step's collectives on empty pieces: no rank waits on this one
                failed = True
                continue
            micro_batch_size = smaller_size(min(micro_batch_size or max(sizes), max(sizes)), s.device)
            num_splits += 1
            continue
        flags = s.agree() if s.agree is not None else []
        if sync is None:
            loss, metrics = running.mean(s.params)
            tokens = sum(map(num_tokens, group))
            return Passes(loss, metrics, micro_batch_size, flags, sum(sizes), tokens, num_splits, running.outputs)
        passes, redo = _settle(sync, running, group, sizes, micro_batch_size, failed, flags, s)
        if not redo:
            passes.num_oom_splits = num_splits
            return passes
        clear_grads(optimizer)  # some rank ran out of memory: every rank redoes the step
        micro_batch_size, failed, num_splits = passes.micro_batch_size, False, num_splits + 1


def _pieces(
    group: Sequence[Any],
    sizes: Sequence[int],
    weights: Sequence[float],
    objective: Objective,
    micro_batch_size: int | None,
    sync: GradSync | None,
    empty: bool,
) -> list[tuple[Any, int, float, int, int]]:
    """``(piece, samples, share, micro-batch index, its first sample's offset)`` for each forward
    of an attempt. Under torchrun every rank runs the same number of pieces per micro-batch (FSDP
    gathers weights in each); ``empty`` gives a rank that ran out of memory pieces of no samples."""
    per_batch = None if sync is None or micro_batch_size is None else -(-sync.batch_size // micro_batch_size)
    if micro_batch_size is None and per_batch is None and not empty:  # each micro-batch is one piece
        return [
            (batch, size, weight, index, 0) for index, (batch, size, weight) in enumerate(zip(group, sizes, weights))
        ]
    pieces = []
    for index, (batch, size, weight) in enumerate(zip(group, sizes, weights)):
        if empty:
            batch, size, weight = empty_like_batch(batch), 0, 0.0
        cut = pieces_of(batch, size, micro_batch_size, per_batch)
        if len(cut) == 1:
            pieces.append((batch, size, weight, index, 0))
            continue
        offset = 0
        for piece in cut:
            n = num_samples(piece)
            pieces.append((piece, n, objective.weight(piece) if n else 0.0, index, offset))
            offset += n
    return pieces


def weighted_loss(loss: torch.Tensor, is_sum: bool, share: float, total: float, synced: bool) -> torch.Tensor:
    """The loss a piece backpropagates. A mean is weighted by the piece's ``share`` of the
    group's count ``total``; a sum goes as it is, its gradients divided by the count once that is
    known (``divide_grads``) — under torchrun divided by ``total`` (``GradSync.nominal``) now and
    rescaled once the job's count is known."""
    if is_sum:
        return loss / total if synced else loss
    return loss if share == total else loss * (share / total)


def divide_grads(params: Sequence[torch.nn.Parameter], count: torch.Tensor) -> None:
    """Gradients of summed losses, divided by the group's count."""
    for p in params:
        if p.grad is not None:
            p.grad.div_(count)


def pieces_of(batch: Any, size: int, micro_batch_size: int | None, count: int | None) -> list[Any]:
    """``batch`` cut to ``micro_batch_size``; padded with empty pieces to ``count`` pieces, so
    that every rank runs the same number of forward passes (FSDP gathers weights in each)."""
    pieces = [batch] if micro_batch_size is None or size <= micro_batch_size else split_batch(batch, micro_batch_size)
    if count is not None and len(pieces) < count:
        pieces += [empty_like_batch(batch)] * (count - len(pieces))
    return pieces


class _Running:
    """The loss, metrics and count of the pieces done so far (detached), and their outputs."""

    def __init__(self, device: torch.device, keep_outputs: bool) -> None:
        self.device = device
        self.loss: torch.Tensor | None = None
        self.metrics: dict[str, torch.Tensor] = {}
        self.counted: torch.Tensor | float | None = None
        self.summed: bool | None = None  # whether the pieces' losses are sums; None until one has samples
        self.outputs: list[tuple[Any, Any]] = []
        self.keep_outputs = keep_outputs

    def add(self, out: Any, loss: torch.Tensor, share: float, total: float, sync: GradSync | None) -> None:
        """A piece with samples: ``out`` as the objective gave it, ``loss`` as it was backpropagated."""
        if self.summed is not None and self.summed != out.is_sum:
            raise ConfigError(
                "loss.step_fn returned a mean for one micro-batch and a StepOutput with a count (a sum) for "
                "another; return the same kind for every batch"
            )
        self.summed = out.is_sum
        if self.keep_outputs:
            outputs = out.outputs.detach() if isinstance(out.outputs, torch.Tensor) else out.outputs
            self.outputs.append((outputs, out.targets))
        detached = loss.detach()
        if detached.dtype != torch.float32:
            detached = detached.float()
        self.loss = detached if self.loss is None else self.loss + detached
        if out.metrics:
            scale = 1.0 if out.is_sum else (share / total if sync is None else share)
            for name, value in out.metrics.items():
                value = torch.as_tensor(value, device=self.device).detach().float()
                value = value if scale == 1.0 else value * scale
                self.metrics[name] = self.metrics[name] + value if name in self.metrics else value
        if out.is_sum or sync is not None:
            count = torch.as_tensor(out.count, device=self.device).float() if out.is_sum else share
            self.counted = count if self.counted is None else self.counted + count

    def mean(self, params: Sequence[torch.nn.Parameter]) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """The mean loss and metrics in one process; summed losses' gradients divided by their count."""
        loss = self.loss if self.loss is not None else torch.zeros((), device=self.device)  # every piece empty
        if not self.summed:
            return loss, self.metrics or None
        count = torch.clamp(torch.as_tensor(self.counted), min=1.0)
        divide_grads(params, count)
        return loss / count, {name: value / count for name, value in self.metrics.items()} or None


def _settle(
    sync: GradSync,
    running: _Running,
    group: Sequence[Any],
    sizes: Sequence[int],
    micro_batch_size: int | None,
    failed: bool,
    flags: Sequence[bool],
    settings: StepSettings,
) -> tuple[Passes, bool]:
    """What every rank's attempt came to, agreed in one all-gather: the job's mean loss with this
    rank's metrics, the micro-batch size every rank goes on with, the flags, the job's samples and
    tokens, and whether every rank redoes the step (some rank ran out of memory: ``failed``)."""
    device = settings.device
    loss_sum = running.loss if running.loss is not None else torch.zeros((), device=device)  # every piece empty
    count = torch.as_tensor(running.counted if running.counted is not None else 0.0, device=device, dtype=torch.float64)
    local = torch.clamp(count, min=1.0)
    metrics = {name: value / local for name, value in running.metrics.items()} or None
    if failed:
        proposal = max(sizes) if micro_batch_size is None else micro_batch_size
        proposal = smaller_size(proposal, device) if proposal > 1 else 0
    else:
        proposal = sync.batch_size if micro_batch_size is None else micro_batch_size
    tokens = sum(map(num_tokens, group))
    # Host sync, the one per step (the guard reads the values it gives without another).
    rows = sync.gather([loss_sum, count, float(failed), proposal, sum(sizes), tokens, *map(float, flags)]).tolist()
    losses, counts, ooms, proposals, samples, job_tokens, *per_flag = zip(*rows)
    agreed = or_flags(flags, per_flag)
    counted = {"num_samples": int(sum(samples)), "num_tokens": int(sum(job_tokens)), "outputs": running.outputs}
    if any(ooms):
        on = [rank for rank, flag in enumerate(ooms) if flag]
        if not settings.split_on_oom:
            raise torch.OutOfMemoryError(f"out of memory on rank {', '.join(map(str, on))} (oom.auto_split is off)")
        if min(proposals) == 0:
            raise SampleTooLarge(
                f"out of memory with a micro-batch of one sample on rank {on[0]}; use a smaller "
                "model, lower precision (bf16) or train.activation_checkpointing"
            )
        return Passes(loss_sum, metrics, int(min(proposals)), agreed, **counted), True
    factor = sync.world_size * sync.nominal / max(sum(counts), 1e-12)
    if factor != 1.0:
        grads = [p.grad for p in settings.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)
    loss = torch.tensor(sum(losses) * factor / sync.world_size, device=device)
    return Passes(loss, metrics, micro_batch_size, agreed, **counted), False


def or_flags(flags: Sequence[bool], per_flag: Sequence[Sequence[float]]) -> Any:
    """Each flag OR-ed over the ranks, in the type of ``flags`` (a ``NamedTuple`` or a list)."""
    values = [any(rank_values) for rank_values in per_flag]
    make = getattr(type(flags), "_make", None)
    return make(values) if make is not None else values
