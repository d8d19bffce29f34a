"""Batch norm over the job's batch (``dist.sync_batchnorm``), and which layers normalize per rank.

Under DDP or FSDP2 a ``BatchNorm*d`` layer in training normalizes with the mean and variance
of its own rank's share of the micro-batch, so 2 ranks × 32 do not train what 1 rank × 64
does. ``sync_batch_norms`` replaces each such layer, in place, by a synced one holding the same
parameter and buffer objects (the same state-dict keys: checkpoints load either way), which
normalizes with the statistics of the job's whole micro-batch:

- on an accelerator, torch's ``SyncBatchNorm``;
- on the CPU (gloo), where torch's raises (and DDP refuses it), ``SyncedBatchNorm1d/2d/3d``:
  one all-reduce of each layer's count, sums and sums of squares per forward, and one of their
  gradients in the backward.

In evaluation, and in one process, it is a plain batch norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchkeel.errors import ConfigError

BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
"""The layers whose training forward uses the statistics of the batch they are given."""


class _SumOverRanks(torch.autograd.Function):
    """The sum over the ranks of ``tensor``; its gradient is the sum of the ranks' gradients
    (every rank's loss depends on every rank's inputs through the sum)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        total = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=ctx.group)
        return total, None


class _SyncedOnCpu:
    """A ``BatchNorm*d`` whose training forward, with several ranks, normalizes a CPU input
    with the mean and (biased) variance of every rank's input, and whose running statistics
    take their unbiased variance, as one process would on the whole batch. Otherwise it is
    torch's ``BatchNorm*d`` (torch's ``SyncBatchNorm`` raises on the CPU, and DDP refuses it there)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.device.type != "cpu" or not self.training or not self._has_other_ranks():
            return super().forward(input)
        self._check_input_dim(input)
        mean, var, count = self._job_statistics(input)
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            with torch.no_grad():
                unbiased = var * (count / (count - 1))
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        dtype = input.dtype if input.dtype == torch.float64 else torch.float32
        shape = (1, -1) + (1,) * (input.dim() - 2)
        scale = torch.rsqrt(var + self.eps).to(dtype)
        out = (input.to(dtype) - mean.to(dtype).view(shape)) * scale.view(shape)
        if self.weight is not None:
            out = out * self.weight.to(dtype).view(shape)
        if self.bias is not None:
            out = out + self.bias.to(dtype).view(shape)
        return out.to(input.dtype)

    def _has_other_ranks(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _job_statistics(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The mean and biased variance per channel over every rank's input (float64, with
        gradients), and the number of values each is over. One all-reduce (a host sync)."""
        dims = [0, *range(2, input.dim())]
        values = input.double()
        local = torch.cat([values.sum(dims), (values * values).sum(dims), values.new_tensor([input.numel()])])
        total = _SumOverRanks.apply(local, None)
        channels = self.num_features
        count = int(total[-1]) // channels  # host sync (CPU): every rank raises together below
        if count <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {count} over every rank's batch"
            )
        mean = total[:channels] / count
        var = (total[channels : 2 * channels] / count - mean * mean).clamp_min(0)
        return mean, var, count


class SyncedBatchNorm1d(_SyncedOnCpu, nn.BatchNorm1d):
    """``BatchNorm1d`` over the job's batch on the CPU (see ``_SyncedOnCpu``)."""


class SyncedBatchNorm2d(_SyncedOnCpu, nn.BatchNorm2d):
    """``BatchNorm2d`` over the job's batch on the CPU (see ``_SyncedOnCpu``)."""


class SyncedBatchNorm3d(_SyncedOnCpu, nn.BatchNorm3d):
    """``BatchNorm3d`` over the job's batch on the CPU (see ``_SyncedOnCpu``)."""


_ON_CPU: dict[type[nn.Module], type[nn.Module]] = {
    nn.BatchNorm1d: SyncedBatchNorm1d,
    nn.BatchNorm2d: SyncedBatchNorm2d,
    nn.BatchNorm3d: SyncedBatchNorm3d,
}


def is_synced(module: nn.Module) -> bool:
    """Whether ``module`` is a batch norm that normalizes over the job's whole batch."""
    return isinstance(module, (nn.SyncBatchNorm, _SyncedOnCpu))


def is_per_rank(module: nn.Module) -> bool:
    """Whether ``module`` is a batch norm that, under DDP or FSDP2, normalizes over its rank's share only."""
    return isinstance(module, BATCH_NORMS) and not is_synced(module)


def _is_convertible(module: nn.Module) -> bool:
    """A per-rank ``BatchNorm*d`` that computes nothing torch's does not (its subclasses may
    only check input dimensions)."""
    return is_per_rank(module) and type(module).forward is nn.BatchNorm1d.forward


def synced(layer: nn.Module, device: torch.device) -> nn.Module:
    """A synced batch norm holding ``layer``'s parameters and buffers (the same objects) and
    mode: torch's ``SyncBatchNorm`` on an accelerator, ``SyncedBatchNorm*d`` on the CPU."""
    if device.type == "cpu":
        kind = next(_ON_CPU[base] for base in BATCH_NORMS if isinstance(layer, base))
        made = kind(
            layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats, device="meta"
        )
    else:
        made = nn.SyncBatchNorm(
            layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats, device="meta"
        )
    made.weight, made.bias = layer.weight, layer.bias
    made.running_mean, made.running_var = layer.running_mean, layer.running_var
    made.num_batches_tracked = layer.num_batches_tracked
    made.train(layer.training)
    return made


def sync_batch_norms(model: nn.Module, device: torch.device) -> int:
    """Replace, in place, each per-rank batch-norm layer inside ``model`` (on ``device``) by a
    synced one that holds its parameters and buffers; return how many. Call before the
    optimizer is built.

    Raises:
        ConfigError: a subclass of ``BatchNorm*d`` has a forward of its own (it cannot be
            replaced without losing what that forward adds).
    """
    custom = sorted({type(m).__name__ for m in model.modules() if is_per_rank(m) and not _is_convertible(m)})
    if custom:
        raise ConfigError(
            f"dist.sync_batchnorm: {', '.join(custom)} subclass a torch BatchNorm with a forward of their own, "
            "which a synced layer would drop; sync them in the model (their library's SyncBatchNorm "
            "conversion) or set dist.sync_batchnorm: false"
        )
    made: dict[int, nn.Module] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _is_convertible(child):
                if id(child) not in made:  # a layer used twice stays one layer
                    made[id(child)] = synced(child, device)
                setattr(parent, name, made[id(child)])
    return len(made)


@dataclass(frozen=True)
class BatchNormUse:
    """How the model's batch-norm layers normalize in a job of several ranks."""

    per_rank: int
    """Layers that normalize with their rank's share of the micro-batch only."""
    synced: int
    """Layers that normalize with the whole micro-batch of the job."""

    @classmethod
    def of(cls, model: nn.Module) -> BatchNormUse:
        modules = list(model.modules())
        return cls(
            per_rank=sum(is_per_rank(m) for m in modules),
            synced=sum(is_synced(m) for m in modules),
        )

    def row(self) -> dict[str, Any]:
        """The ``dist`` row's fields: ``batch_norm`` (``per_rank`` when any layer is, else
        ``synced``) and ``batch_norm_layers`` (how many layers are so); none without batch norm."""
        if self.per_rank:
            return {"batch_norm": "per_rank", "batch_norm_layers": self.per_rank}
        if self.synced:
            return {"batch_norm": "synced", "batch_norm_layers": self.synced}
        return {}

    def warning(self, batch_size: int, world_size: int) -> str | None:
        """The line to say at the start when layers normalize per rank; ``None`` otherwise."""
        if not self.per_rank:
            return None
        return (
            f"{self.per_rank} BatchNorm layer(s) normalize with each rank's own share of the batch "
            f"({batch_size // world_size} samples, not the job's {batch_size}), so {world_size} ranks do not "
            "train what one process does; set dist.sync_batchnorm: true to normalize over the whole batch"
        )
