"""The one place the order of a training step is written.

forward (autocast) → weighted backward per micro-batch (split further on out-of-memory) →
unscale → clip → non-finite guard → optimizer step → zero_grad → scheduler step.
The only host sync is the guard's, once per step, when ``check_finite`` is on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from torchkeel.batch import num_samples, num_tokens, split_batch
from torchkeel.distributed.agree import read_finite
from torchkeel.distributed.parallel import GradSync, empty_like_batch
from torchkeel.errors import SampleTooLarge
from torchkeel.train.clipping import clip_grad_norm
from torchkeel.train.hooks import TrainerHooks
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
    """``train_step``'s ``agree`` flags, of the type ``agree()`` returned, each true when it was
    true on any rank."""


@dataclass
class _Sums:
    """What the forward and backward of a group's pieces add up to on this rank."""

    loss: torch.Tensor
    """The mean loss (in one process); this rank's weighted sum under ``sync``."""
    metrics: dict[str, torch.Tensor] | None
    count: torch.Tensor | None = None
    """This rank's count (``sync`` only: the global divisor is known after the all-gather)."""


@dataclass
class _Attempt:
    """One data-parallel attempt at a step, as every rank agreed on it."""

    sums: _Sums
    micro_batch_size: int | None
    """The micro-batch size every rank continues with."""
    agreed: Any
    redo: bool
    """Some rank ran out of memory: every rank redoes the step."""
    samples: int = 0
    """The job's samples in the step."""
    tokens: int = 0
    """The job's token positions in the step."""


@dataclass
class _Work:
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


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    group: Sequence[Any],
    loss_fn: Callable[[Any, Any], torch.Tensor] | Objective,
    *,
    params: Sequence[torch.nn.Parameter],
    precision: Precision,
    device: torch.device,
    clip_grad_norm_max: float | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    check_finite: bool = False,
    split_on_oom: bool = False,
    micro_batch_size: int | None = None,
    sync: GradSync | None = None,
    on_outputs: Callable[[Any, Any], None] | None = None,
    agree: Callable[[], Sequence[bool]] | None = None,
    hooks: TrainerHooks | None = None,
) -> StepResult:
    """One optimizer step over ``group``, a list of micro-batches.

    ``loss_fn`` is ``loss(output, target)`` for ``(input, target)`` batches, or an ``Objective``
    (a step function, batches of any shape, a count other than samples). Each piece's loss is
    weighted by its share of the group's count (samples by default), so the update equals a
    single step on the concatenated batch, including a short last group. ``params`` are the
    trainable parameters (measured and clipped). With ``check_finite``, a step whose loss or
    gradients are NaN/Inf is not applied: parameters, optimizer state and step counts stay as
    they were and the scheduler does not advance. With ``split_on_oom``, an out-of-memory error
    redoes the step in pieces of half the size (``micro_batch_size`` caps them from the start);
    ``hooks.before_forward(num_samples)`` runs before each piece (fault injection in tests).

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
    if not group:
        raise ValueError("train_step needs at least one micro-batch")
    objective = loss_fn if isinstance(loss_fn, Objective) else Objective(loss_fn)
    sizes = list(map(num_samples, group))
    weights = list(map(objective.weight, group)) if objective.count_key else list(map(float, sizes))
    num_splits, agreed, job = 0, [], None
    seen: list[tuple[Any, Any]] | None = [] if on_outputs is not None else None
    before_forward = hooks.before_forward if hooks is not None else None
    work = _Work(model, group, sizes, weights, objective, precision, device, params, before_forward, seen)
    while True:
        if seen is not None:
            seen.clear()
        if sync is not None:  # every rank tries; all redo the step if any ran out of memory
            job = _synced(work, micro_batch_size, sync, split_on_oom, agree)
            sums, micro_batch_size, agreed = job.sums, job.micro_batch_size, job.agreed
            if not job.redo:
                break
            clear_grads(optimizer)
            num_splits += 1
            continue
        try:
            sums = _forward_backward(work, micro_batch_size)
            agreed = agree() if agree is not None else []
            break
        except torch.OutOfMemoryError:
            if not split_on_oom:
                raise
        # Out of the except block, so the failed attempt's frames and tensors can be freed.
        clear_grads(optimizer)
        free_memory(device)
        micro_batch_size = smaller_size(min(micro_batch_size or max(sizes), max(sizes)), device)
        num_splits += 1
    loss_sum = sums.loss
    precision.unscale_(optimizer)
    grad_norm = clip_grad_norm(params, clip_grad_norm_max)
    status, loss_value, norm_value = "ok", None, None
    if check_finite:
        # Host sync, the one per step: may this step be applied? Loss and norm come along.
        (loss_value, norm_value), (loss_ok, grads_ok) = read_finite((loss_sum, grad_norm), agreed=sync is not None)
        if not (loss_ok and grads_ok):
            status = "overflow" if loss_ok and precision.scaler is not None else "nonfinite"
    if status == "nonfinite":
        precision.skip(optimizer)
    else:
        precision.step(optimizer)  # on "overflow" the scaler skips the update and lowers its scale
    clear_grads(optimizer)
    if scheduler is not None and status == "ok":
        scheduler.step()
    if seen is not None and status != "nonfinite":
        for outputs, targets in seen:
            on_outputs(outputs, targets)
    return StepResult(
        loss=loss_sum,
        grad_norm=grad_norm,
        num_samples=sum(sizes) if job is None else job.samples,
        num_tokens=sum(map(num_tokens, group)) if job is None else job.tokens,
        num_micro_batches=len(group),
        status=status,
        loss_value=loss_value,
        grad_norm_value=norm_value,
        micro_batch_size=micro_batch_size,
        num_oom_splits=num_splits,
        metrics=sums.metrics,
        agreed=agreed,
    )


@dataclass(frozen=True)
class StepSettings:
    """What every step of a run shares: ``train_step``'s settings, typed. ``run`` takes a step."""

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

    def run(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        group: Sequence[Any],
        loss_fn: Callable[[Any, Any], torch.Tensor] | Objective,
        micro_batch_size: int | None = None,
    ) -> StepResult:
        """``train_step`` of ``group`` with these settings."""
        return train_step(
            model,
            optimizer,
            group,
            loss_fn,
            params=self.params,
            precision=self.precision,
            device=self.device,
            clip_grad_norm_max=self.clip_grad_norm_max,
            scheduler=self.scheduler,
            check_finite=self.check_finite,
            split_on_oom=self.split_on_oom,
            micro_batch_size=micro_batch_size,
            sync=self.sync,
            on_outputs=self.on_outputs,
            agree=self.agree,
            hooks=self.hooks,
        )


def _pieces(batch: Any, size: int, micro_batch_size: int | None, count: int | None) -> list[Any]:
    """``batch`` cut to ``micro_batch_size``; padded with empty pieces to ``count`` pieces, so
    that every rank runs the same number of forward passes (FSDP gathers weights in each)."""
    pieces = [batch] if micro_batch_size is None or size <= micro_batch_size else split_batch(batch, micro_batch_size)
    if count is not None and len(pieces) < count:
        pieces += [empty_like_batch(batch)] * (count - len(pieces))
    return pieces


def _synced(
    work: _Work,
    micro_batch_size: int | None,
    sync: GradSync,
    split_on_oom: bool,
    agree: Callable[[], Sequence[bool]] | None,
) -> _Attempt:
    """One data-parallel attempt at the step: the job's mean loss with this rank's metrics, the
    micro-batch size every rank continues with, the agreed flags, whether every rank must redo
    the step, and the job's samples and tokens."""
    per_batch = None if micro_batch_size is None else -(-sync.batch_size // micro_batch_size)
    group, sizes, device = work.group, work.sizes, work.device
    oom = False
    sums = None
    try:
        sums = _forward_backward(work, micro_batch_size, sync=sync, pieces_per_batch=per_batch)
    except torch.OutOfMemoryError:
        oom = True
    if oom:
        # Finish the step's collectives on empty pieces, so that no rank waits on this one.
        free_memory(device)
        empty = [empty_like_batch(batch) for batch in group]
        nothing = dataclasses.replace(
            work, group=empty, sizes=[0] * len(group), weights=[0.0] * len(group), before_forward=None, seen=None
        )
        sums = _forward_backward(nothing, micro_batch_size, sync=sync, pieces_per_batch=per_batch)
        proposal = max(sizes) if micro_batch_size is None else micro_batch_size
        proposal = smaller_size(proposal, device) if proposal > 1 else 0
    else:
        proposal = sync.batch_size if micro_batch_size is None else micro_batch_size
    # Host sync, the one per step (the guard reads the values it gives without another).
    flags = agree() if agree is not None else []
    tokens = sum(map(num_tokens, group))
    rows = sync.gather([sums.loss, sums.count, float(oom), proposal, sum(sizes), tokens, *map(float, flags)]).tolist()
    losses, counts, ooms, proposals, samples, job_tokens, *per_flag = zip(*rows)
    agreed = _or_flags(flags, per_flag)
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
        return _Attempt(sums, int(min(proposals)), agreed, True, **counted)
    factor = sync.world_size * sync.nominal / max(sum(counts), 1e-12)
    if factor != 1.0:
        grads = [p.grad for p in work.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)
    loss = torch.tensor(sum(losses) * factor / sync.world_size, device=device)
    return _Attempt(_Sums(loss, sums.metrics), micro_batch_size, agreed, False, **counted)


def _or_flags(flags: Sequence[bool], per_flag: Sequence[Sequence[float]]) -> Any:
    """Each flag OR-ed over the ranks, in the type of ``flags`` (a ``NamedTuple`` or a list)."""
    values = [any(rank_values) for rank_values in per_flag]
    make = getattr(type(flags), "_make", None)
    return make(values) if make is not None else values


def _forward_backward(
    work: _Work, micro_batch_size: int | None, sync: GradSync | None = None, pieces_per_batch: int | None = None
) -> _Sums:
    """Forward and backward of every piece, weighted by its count; returns the mean loss and metrics.

    A mean loss is scaled by its piece's share of the group's count before its backward. Summed
    losses (a step function that returns ``loss_sum, count``) are backpropagated as they are and
    the gradients divided by the group's total count at the end, since it is known only then.
    With ``sync`` the divisor is ``sync.nominal`` instead (the global count is known only after
    the all-gather) and this returns this rank's loss sum, metrics and count for ``_synced``.
    """
    model, group, sizes, weights, objective, precision, device, params, before_forward, seen = (
        work.model, work.group, work.sizes, work.weights, work.objective, work.precision, work.device,
        work.params, work.before_forward, work.seen,
    )  # fmt: skip
    if sync is None and len(group) == 1 and micro_batch_size is None and before_forward is None and sizes[0]:
        return _whole_batch(work)
    non_blocking = device.type == "cuda"
    total = sum(weights) if sync is None else sync.nominal
    loss_sum: torch.Tensor | None = None
    metric_sums: dict[str, torch.Tensor] = {}
    counted: torch.Tensor | float = 0.0
    summed: bool | None = None  # whether the pieces' losses are sums; None until one has samples
    whole = micro_batch_size is None and pieces_per_batch is None  # each batch is one piece
    autocast = precision.autocast()  # entered once per piece
    for index, (batch, size, weight) in enumerate(zip(group, sizes, weights)):
        pieces = [batch] if whole else _pieces(batch, size, micro_batch_size, pieces_per_batch)
        offset = 0
        for number, piece in enumerate(pieces):
            if len(pieces) == 1:
                n, share = size, weight
            else:
                n = num_samples(piece)
                share = objective.weight(piece) if n else 0.0
            if before_forward is not None and n:
                before_forward(n)
            is_last = index == len(group) - 1 and number == len(pieces) - 1
            with sync.micro_batch(is_last) if sync is not None else _NOTHING:
                try:
                    with autocast:
                        out = objective(model, piece, device, non_blocking)
                except LabelOutOfRange as exc:
                    exc.micro_batch, exc.sample = index, exc.sample + offset
                    raise
                offset += n
                if n:
                    if summed is not None and summed != out.is_sum:
                        raise ValueError(
                            "loss.step_fn returned a mean for one micro-batch and a (sum, count) for another"
                        )
                    summed = out.is_sum
                    if seen is not None:
                        outputs = out.outputs.detach() if isinstance(out.outputs, torch.Tensor) else out.outputs
                        seen.append((outputs, out.targets))
                if out.is_sum:
                    loss = out.loss / total if sync is not None else out.loss
                else:
                    loss = out.loss if share == total else out.loss * (share / total)
                precision.backward(loss)  # an empty piece (n == 0) adds zero gradients
            if not n:
                continue
            detached = loss.detach()
            if detached.dtype != torch.float32:
                detached = detached.float()
            loss_sum = detached if loss_sum is None else loss_sum + detached
            if out.metrics:
                scale = 1.0 if out.is_sum else (share / total if sync is None else share)
                for name, value in out.metrics.items():
                    value = torch.as_tensor(value, device=device).detach().float() * scale
                    metric_sums[name] = metric_sums[name] + value if name in metric_sums else value
            if out.is_sum or sync is not None:
                counted = counted + (torch.as_tensor(out.count, device=device).float() if out.is_sum else share)
    if loss_sum is None:  # every piece was empty (a rank without data this step)
        loss_sum = torch.zeros((), device=device)
    if sync is not None:
        count = torch.as_tensor(counted, device=device, dtype=torch.float64)
        local = torch.clamp(count, min=1.0)
        return _Sums(loss_sum, {name: value / local for name, value in metric_sums.items()} or None, count)
    if summed:
        counted = torch.clamp(torch.as_tensor(counted), min=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.div_(counted)
        loss_sum = loss_sum / counted
        metric_sums = {name: value / counted for name, value in metric_sums.items()}
    return _Sums(loss_sum, metric_sums or None)


def _whole_batch(work: _Work) -> _Sums:
    """``_forward_backward`` of the usual step (one process, one micro-batch that fits): the same
    arithmetic as its loop with one piece of share 1, with less Python between the kernels."""
    model, objective, precision, device, seen = work.model, work.objective, work.precision, work.device, work.seen
    batch = work.group[0]
    with precision.autocast():
        out = objective(model, batch, device, device.type == "cuda")
    precision.backward(out.loss)
    if seen is not None:
        seen.append((out.outputs.detach() if isinstance(out.outputs, torch.Tensor) else out.outputs, out.targets))
    loss = out.loss.detach().float()
    metrics = {k: torch.as_tensor(v, device=device).detach().float() for k, v in out.metrics.items()}
    if not out.is_sum:
        return _Sums(loss, metrics or None)
    count = torch.clamp(torch.as_tensor(out.count, device=device).float(), min=1.0)
    for p in work.params:
        if p.grad is not None:
            p.grad.div_(count)
    return _Sums(loss / count, {k: v / count for k, v in metrics.items()} or None)
