"""The forward and backward passes of one step's micro-batches, each loss weighted by its share.

``train_step`` (``torchkeel.train.step``) calls ``until_it_fits``: the passes over the group,
redone in smaller pieces after an out-of-memory error, and under torchrun agreed by every rank
in one all-gather. How a piece's loss is weighted is written once, in ``weighted_loss``; a step
function's summed losses are divided by their count once it is known (``divide_grads``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from torchkeel.batch import num_samples, num_tokens, split_batch
from torchkeel.distributed.parallel import GradSync, empty_like_batch
from torchkeel.errors import SampleTooLarge
from torchkeel.train.objective import LabelOutOfRange, Objective
from torchkeel.train.oom import free_memory, smaller_size
from torchkeel.train.precision import Precision

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
class Sums:
    """What the forward and backward of a group's pieces add up to on this rank."""

    loss: torch.Tensor
    """The mean loss (in one process); this rank's weighted sum under ``sync``."""
    metrics: dict[str, torch.Tensor] | None
    count: torch.Tensor | None = None
    """This rank's count (``sync`` only: the global divisor is known after the all-gather)."""


@dataclass
class Attempt:
    """The passes of a step as they ended: the sums, the micro-batch size that fit, the agreed
    flags, the job's samples and tokens, and the out-of-memory splits it took."""

    sums: Sums
    micro_batch_size: int | None
    agreed: Any
    redo: bool = False
    """Some rank ran out of memory: every rank redoes the step."""
    samples: int = 0
    tokens: int = 0
    num_splits: int = 0


@dataclass
class Work:
    """What every attempt at one step's forward and backward shares (a redo after an
    out-of-memory error changes only the micro-batch size)."""

    model: torch.nn.Module
    group: Sequence[Any]
    sizes: Sequence[int]
    weights: Sequence[float]
    objective: Objective
    precision: Precision
    device: torch.device
    params: Sequence[torch.nn.Parameter]
    before_forward: Callable[[int], None] | None = None
    seen: list[tuple[Any, Any]] | None = None


def until_it_fits(
    work: Work,
    optimizer: torch.optim.Optimizer,
    micro_batch_size: int | None,
    sync: GradSync | None,
    split_on_oom: bool,
    agree: Callable[[], Sequence[bool]] | None,
) -> Attempt:
    """The passes over ``work.group``; after an out-of-memory error (with ``split_on_oom``) the
    gradients are dropped and the step redone in pieces of half the size, until it fits."""
    num_splits = 0
    while True:
        if work.seen is not None:
            work.seen.clear()
        if sync is not None:  # every rank tries; all redo the step if any ran out of memory
            attempt = synced_attempt(work, micro_batch_size, sync, split_on_oom, agree)
            micro_batch_size = attempt.micro_batch_size
            if not attempt.redo:
                attempt.num_splits = num_splits
                return attempt
            clear_grads(optimizer)
            num_splits += 1
            continue
        try:
            sums = forward_backward(work, micro_batch_size)
            agreed = agree() if agree is not None else []
            samples, tokens = sum(work.sizes), sum(map(num_tokens, work.group))
            return Attempt(sums, micro_batch_size, agreed, False, samples, tokens, num_splits)
        except torch.OutOfMemoryError:
            if not split_on_oom:
                raise
        # Out of the except block, so the failed attempt's frames and tensors can be freed.
        clear_grads(optimizer)
        free_memory(work.device)
        micro_batch_size = smaller_size(min(micro_batch_size or max(work.sizes), max(work.sizes)), work.device)
        num_splits += 1


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


def synced_attempt(
    work: Work,
    micro_batch_size: int | None,
    sync: GradSync,
    split_on_oom: bool,
    agree: Callable[[], Sequence[bool]] | None,
) -> Attempt:
    """One data-parallel attempt at the step: the job's mean loss with this rank's metrics, the
    micro-batch size every rank continues with, the agreed flags, whether every rank must redo
    the step, and the job's samples and tokens."""
    per_batch = None if micro_batch_size is None else -(-sync.batch_size // micro_batch_size)
    group, sizes, device = work.group, work.sizes, work.device
    oom = False
    sums = None
    try:
        sums = forward_backward(work, micro_batch_size, sync=sync, pieces_per_batch=per_batch)
    except torch.OutOfMemoryError:
        oom = True
    if oom:
        # Finish the step's collectives on empty pieces, so that no rank waits on this one.
        free_memory(device)
        empty = [empty_like_batch(batch) for batch in group]
        nothing = dataclasses.replace(
            work, group=empty, sizes=[0] * len(group), weights=[0.0] * len(group), before_forward=None, seen=None
        )
        sums = forward_backward(nothing, micro_batch_size, sync=sync, pieces_per_batch=per_batch)
        proposal = max(sizes) if micro_batch_size is None else micro_batch_size
        proposal = smaller_size(proposal, device) if proposal > 1 else 0
    else:
        proposal = sync.batch_size if micro_batch_size is None else micro_batch_size
    # Host sync, the one per step (the guard reads the values it gives without another).
    flags = agree() if agree is not None else []
    tokens = sum(map(num_tokens, group))
    rows = sync.gather([sums.loss, sums.count, float(oom), proposal, sum(sizes), tokens, *map(float, flags)]).tolist()
    losses, counts, ooms, proposals, samples, job_tokens, *per_flag = zip(*rows)
    agreed = or_flags(flags, per_flag)
    counted = {"samples": int(sum(samples)), "tokens": int(sum(job_tokens))}
    if any(ooms):
        failed = [rank for rank, flag in enumerate(ooms) if flag]
        if not split_on_oom:
            raise torch.OutOfMemoryError(f"out of memory on rank {', '.join(map(str, failed))} (oom.auto_split is off)")
        if min(proposals) == 0:
            raise SampleTooLarge(
                f"out of memory with a micro-batch of one sample on rank {failed[0]}; use a smaller "
                "model, lower precision (bf16) or train.activation_checkpointing"
            )
        return Attempt(sums, int(min(proposals)), agreed, True, **counted)
    factor = sync.world_size * sync.nominal / max(sum(counts), 1e-12)
    if factor != 1.0:
        grads = [p.grad for p in work.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)
    loss = torch.tensor(sum(losses) * factor / sync.world_size, device=device)
    return Attempt(Sums(loss, sums.metrics), micro_batch_size, agreed, False, **counted)


def or_flags(flags: Sequence[bool], per_flag: Sequence[Sequence[float]]) -> Any:
    """Each flag OR-ed over the ranks, in the type of ``flags`` (a ``NamedTuple`` or a list)."""
    values = [any(rank_values) for rank_values in per_flag]
    make = getattr(type(flags), "_make", None)
    return make(values) if make is not None else values


class _Running:
    """The loss, metrics and count of the pieces done so far (detached)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.loss: torch.Tensor | None = None
        self.metrics: dict[str, torch.Tensor] = {}
        self.counted: torch.Tensor | float = 0.0
        self.summed: bool | None = None  # whether the pieces' losses are sums; None until one has samples

    def add(self, out: Any, loss: torch.Tensor, share: float, total: float, sync: GradSync | None) -> None:
        if self.summed is not None and self.summed != out.is_sum:
            raise ValueError("loss.step_fn returned a mean for one micro-batch and a (sum, count) for another")
        self.summed = out.is_sum
        detached = loss.detach()
        if detached.dtype != torch.float32:
            detached = detached.float()
        self.loss = detached if self.loss is None else self.loss + detached
        if out.metrics:
            scale = 1.0 if out.is_sum else (share / total if sync is None else share)
            for name, value in out.metrics.items():
                value = torch.as_tensor(value, device=self.device).detach().float() * scale
                self.metrics[name] = self.metrics[name] + value if name in self.metrics else value
        if out.is_sum or sync is not None:
            self.counted = self.counted + (
                torch.as_tensor(out.count, device=self.device).float() if out.is_sum else share
            )


def forward_backward(
    work: Work, micro_batch_size: int | None, sync: GradSync | None = None, pieces_per_batch: int | None = None
) -> Sums:
    """Forward and backward of every piece, weighted by its count (``weighted_loss``); returns
    the mean loss and metrics. With ``sync`` the divisor is ``sync.nominal`` (the global count is
    known only after the all-gather) and this returns this rank's loss sum, metrics and count for
    ``synced_attempt``.
    """
    group, sizes, device = work.group, work.sizes, work.device
    if sync is None and len(group) == 1 and micro_batch_size is None and work.before_forward is None and sizes[0]:
        return _whole_batch(work)
    total = sum(work.weights) if sync is None else sync.nominal
    running = _Running(device)
    whole = micro_batch_size is None and pieces_per_batch is None  # each batch is one piece
    autocast = work.precision.autocast()  # entered once per piece
    for index, (batch, size, weight) in enumerate(zip(group, sizes, work.weights)):
        pieces = [batch] if whole else pieces_of(batch, size, micro_batch_size, pieces_per_batch)
        offset = 0
        for number, piece in enumerate(pieces):
            n, share = (size, weight) if len(pieces) == 1 else (num_samples(piece), None)
            if share is None:
                share = work.objective.weight(piece) if n else 0.0
            is_last = index == len(group) - 1 and number == len(pieces) - 1
            out, loss = _piece(work, piece, n, share, total, sync, is_last, autocast, index, offset)
            offset += n
            if n:
                running.add(out, loss, share, total, sync)
    loss_sum = running.loss if running.loss is not None else torch.zeros((), device=device)  # every piece empty
    if sync is not None:
        count = torch.as_tensor(running.counted, device=device, dtype=torch.float64)
        local = torch.clamp(count, min=1.0)
        return Sums(loss_sum, {name: value / local for name, value in running.metrics.items()} or None, count)
    metric_sums = running.metrics
    if running.summed:
        counted = torch.clamp(torch.as_tensor(running.counted), min=1.0)
        divide_grads(work.params, counted)
        loss_sum = loss_sum / counted
        metric_sums = {name: value / counted for name, value in metric_sums.items()}
    return Sums(loss_sum, metric_sums or None)


def _piece(
    work: Work,
    piece: Any,
    n: int,
    share: float,
    total: float,
    sync: GradSync | None,
    is_last: bool,
    autocast: Any,
    index: int,
    offset: int,
) -> tuple[Any, torch.Tensor]:
    """Forward and weighted backward of one piece (``n`` samples; an empty one adds zero
    gradients); returns the objective's output and the loss that was backpropagated."""
    if work.before_forward is not None and n:
        work.before_forward(n)
    with sync.micro_batch(is_last) if sync is not None else _NOTHING:
        try:
            with autocast:
                out = work.objective(work.model, piece, work.device, work.device.type == "cuda")
        except LabelOutOfRange as exc:
            exc.micro_batch, exc.sample = index, exc.sample + offset
            raise
        if n and work.seen is not None:
            outputs = out.outputs.detach() if isinstance(out.outputs, torch.Tensor) else out.outputs
            work.seen.append((outputs, out.targets))
        loss = weighted_loss(out.loss, out.is_sum, share, total, sync is not None)
        work.precision.backward(loss)
    return out, loss


def _whole_batch(work: Work) -> Sums:
    """``forward_backward`` of the usual step (one process, one micro-batch that fits): the same
    arithmetic as its loop with one piece of share 1, with less Python between the kernels."""
    objective, precision, device, seen = work.objective, work.precision, work.device, work.seen
    batch = work.group[0]
    with precision.autocast():
        out = objective(work.model, batch, device, device.type == "cuda")
    precision.backward(weighted_loss(out.loss, out.is_sum, 1.0, 1.0, synced=False))
    if seen is not None:
        seen.append((out.outputs.detach() if isinstance(out.outputs, torch.Tensor) else out.outputs, out.targets))
    loss = out.loss.detach().float()
    metrics = {k: torch.as_tensor(v, device=device).detach().float() for k, v in out.metrics.items()}
    if not out.is_sum:
        return Sums(loss, metrics or None)
    count = torch.clamp(torch.as_tensor(out.count, device=device).float(), min=1.0)
    divide_grads(work.params, count)
    return Sums(loss / count, {k: v / count for k, v in metrics.items()} or None)
