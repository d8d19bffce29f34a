"""Data parallelism: wrap the model for the strategy (DDP or FSDP2) and control gradient sync.

The training step asks ``GradSync`` for two things: a context per micro-batch (sync only on the
last one: ``no_sync`` for DDP, ``set_requires_gradient_sync(False)`` for FSDP2) and one
all-gather per step of what every rank must know (counts, losses, out-of-memory flags).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from torchkeel.batch import map_tensors
from torchkeel.config.schema import DistConfig
from torchkeel.distributed.batchnorm import sync_batch_norms
from torchkeel.errors import ConfigError

Strategy = str  # "none" | "ddp" | "fsdp"


def resolve_strategy(cfg: DistConfig, world_size: int) -> Strategy:
    """``auto`` → ``ddp`` with several ranks, ``none`` in one process; ``fsdp`` stays ``fsdp``
    (in one process the model is not wrapped, but checkpoints keep the sharded layout)."""
    if cfg.strategy == "auto":
        return "ddp" if world_size > 1 else "none"
    if cfg.strategy == "ddp" and world_size == 1:
        return "none"
    return cfg.strategy


def apply_activation_checkpointing(
    model: torch.nn.Module, class_names: list[str], key: str = "dist.activation_checkpointing"
) -> int:
    """Recompute the activations of every module whose class is named, in the backward pass;
    return how many modules. The state-dict keys do not change (the forward is wrapped in place),
    and the random state is replayed (dropout draws the same masks)."""
    if not class_names:
        return 0
    wanted = set(class_names)
    found = [m for m in model.modules() if type(m).__name__ in wanted]
    if not found:
        raise ConfigError(
            f"{key}: no module of class {sorted(wanted)} in the model; "
            f"its classes: {sorted({type(m).__name__ for m in model.modules()})}"
        )
    for module in found:
        module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)
    return len(found)


def shard_targets(model: torch.nn.Module, class_names: list[str]) -> list[torch.nn.Module]:
    """The modules FSDP shards one by one (the root comes last): those of the named classes, or
    by default the repeated blocks — children of a ``ModuleList``/``Sequential`` with parameters."""
    if class_names:
        wanted = set(class_names)
        found = [m for m in model.modules() if type(m).__name__ in wanted and m is not model]
        if not found:
            raise ConfigError(
                f"dist.shard_modules: no module of class {sorted(wanted)} in the model; "
                f"its classes: {sorted({type(m).__name__ for m in model.modules()})}"
            )
        return found
    blocks = []
    for module in model.modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            blocks += [child for child in module.children() if any(True for _ in child.parameters())]
    return [b for b in blocks if b is not model]


def wrap_model(
    model: torch.nn.Module,
    strategy: Strategy,
    cfg: DistConfig,
    device: torch.device,
    precision: str = "fp32",
) -> torch.nn.Module:
    """The module to call: ``DistributedDataParallel(model)``, the model sharded in place by
    FSDP2's ``fully_shard``, or the model itself (one process). Call after ``model.to(device)``
    and before the optimizer is built: with ``cfg.sync_batchnorm`` and several ranks, the
    model's batch-norm layers are replaced in place by synced ones (the same parameters)."""
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if strategy == "none" or not (dist.is_available() and dist.is_initialized()):
        return model
    if cfg.sync_batchnorm:
        sync_batch_norms(model, device)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=cfg.find_unused_parameters)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None)
    for block in shard_targets(model, cfg.shard_modules):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside a DDP wrapper (FSDP2 shards in place: the same object)."""
    return getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model


class GradSync:
    """Gradient sync of one data-parallel step, for ``train_step``.

    ``batch_size`` is the per-rank micro-batch. ``nominal`` is the count a full step holds on
    one rank (per-rank batch × accumulate): each
    piece's loss is weighted by its count over ``nominal`` before its backward, and once the
    global count is known the gradients are rescaled by ``world_size × nominal / global count``,
    which is exactly 1 for full steps counted in samples. The result equals one step on the whole
    global batch in one process, whatever the number of ranks.
    """

    def __init__(self, model: torch.nn.Module, batch_size: int, accumulate: int, device: torch.device) -> None:
        self.model, self.batch_size, self.device = model, batch_size, device
        self.nominal = float(batch_size * accumulate)
        self.world_size = dist.get_world_size()
        self._fsdp = hasattr(model, "set_requires_gradient_sync")
        self._ddp = hasattr(model, "no_sync")

    @contextmanager
    def micro_batch(self, is_last: bool) -> Iterator[None]:
        """Gradients are reduced across ranks only in the last micro-batch's backward."""
        if is_last:
            if self._fsdp:
                self.model.set_requires_gradient_sync(True)
            yield
            return
        if self._fsdp:
            self.model.set_requires_gradient_sync(False)
            yield
        else:
            with self.model.no_sync() if self._ddp else nullcontext():
                yield

    def gather(self, values: list[float | torch.Tensor]) -> torch.Tensor:
        """Every rank's ``values`` in one collective: a ``[world_size, len(values)]`` float64 tensor."""
        row = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device).reshape(()) for v in values])
        rows = torch.empty(self.world_size * row.numel(), dtype=torch.float64, device=self.device)
        dist.all_gather_single(rows, row)
        return rows.view(self.world_size, row.numel())


def empty_like_batch(batch: Any) -> Any:
    """A batch of the same structure with no samples: what a rank whose share is empty computes
    on, so that every rank takes part in the same collectives."""
    return map_tensors(batch, lambda t: t[:0] if t.dim() > 0 else t)


def even_batches(batches: Iterator[Any], device: torch.device, enabled: bool) -> Iterator[Any]:
    """Yield until every rank ran out, a rank that ran out first yielding empty batches: ranks
    whose streams hold different numbers of batches stay in step. One collective per batch; a
    rank that has no batch at all (fewer files than ranks) gets the batch's structure from one
    that has, in one more collective, once."""
    if not enabled:
        yield from batches
        return
    template = None
    while True:
        batch = next(batches, None)
        flags = torch.tensor([batch is not None, batch is None and template is None], dtype=torch.int32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        has_batch, needs_template = (bool(v) for v in flags.tolist())  # host sync: the decision is the host's
        if not has_batch:
            return
        if template is None and batch is not None:
            template = empty_like_batch(batch)
        if needs_template:  # every rank offers its empty batch; one that has none takes another's
            offered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(offered, template)
            template = template if template is not None else next(t for t in offered if t is not None)
        yield batch if batch is not None else template
