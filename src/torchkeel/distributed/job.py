"""The distributed side of a training run, in one component the Trainer composes.

``TrainingJob`` owns the process group, the wrapped model, gradient sync and the per-rank part
of checkpoints (every rank's RNG and data position). In one process it is inert: the same
Trainer code runs with and without ``torchrun``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from torchkeel.config.schema import DistConfig
from torchkeel.distributed.batchnorm import BatchNormUse
from torchkeel.distributed.group import JobGroup
from torchkeel.distributed.parallel import (
    GradSync,
    even_batches,
    resolve_strategy,
    unwrap,
    wrap_model,
)
from torchkeel.distributed.rank import RankInfo, per_rank
from torchkeel.rng import seed_everything


class TrainingJob:
    """Joins the job, wraps the model, and gathers what each rank must checkpoint.

    Example::

        job = TrainingJob(cfg.dist, RankInfo.from_env(), device)
        try:
            forward_model = job.wrap(model, precision="fp32", batch_size=64, accumulate=1)
            ...  # train_step(forward_model, ..., StepSettings(..., sync=job.sync))
        finally:
            job.close()
    """

    def __init__(self, cfg: DistConfig, rank: RankInfo, device: torch.device) -> None:
        self.cfg, self.rank, self.device = cfg, rank, device
        self.group = JobGroup(cfg, rank, device)
        self.strategy = resolve_strategy(cfg, rank.world_size)
        self.sync: GradSync | None = None
        self.batch_norms = BatchNormUse(per_rank=0, synced=0)

    @property
    def active(self) -> bool:
        return self.group.active

    @property
    def sharded(self) -> bool:
        """Whether checkpoints use the sharded (DCP) layout: ``dist.strategy: fsdp``, on any number of ranks."""
        return self.strategy == "fsdp"

    def wrap(self, model: torch.nn.Module, *, precision: str, batch_size: int, accumulate: int) -> torch.nn.Module:
        """The module to run forward on; sets ``sync`` for ``train_step`` and ``batch_norms`` (how
        the model's batch norms normalize) when the job has several ranks. ``batch_size`` is the
        global batch."""
        wrapped = wrap_model(model, self.strategy, self.cfg, self.device, precision)
        if self.active:
            self.sync = GradSync(wrapped, per_rank(batch_size, self.rank.world_size), accumulate, self.device)
            self.batch_norms = BatchNormUse.of(model)
        return wrapped

    def seed_rank(self, seed: int) -> None:
        """Give each rank its own random stream (dropout) once the model is built identically everywhere."""
        if self.rank.world_size > 1:
            seed_everything(seed * 1000003 + self.rank.rank + 1)

    def evaluation_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module validation runs on: the plain module under DDP (no collectives), FSDP's otherwise."""
        return unwrap(model)

    def batches(self, batches: Iterator[Any], streaming: bool) -> Iterator[Any]:
        """Keep the ranks in step when their streams hold different numbers of batches."""
        return even_batches(batches, self.device, enabled=True) if self.active and streaming else batches

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` (plain data), on rank 0; ``None`` on the others."""
        if not self.active:
            return [value]
        values: list[Any] | None = [None] * self.rank.world_size if self.rank.is_main else None
        dist.gather_object(value, values, dst=0)
        return values

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (plain data), on every rank, in rank order."""
        if not self.active:
            return [value]
        values: list[Any] = [None] * self.rank.world_size
        dist.all_gather_object(values, value)
        return values

    def watch(self, what: str, step: int) -> AbstractContextManager[None]:
        """A timeout inside the block becomes a ``CollectiveTimeout`` naming ``what``, the step and the rank."""
        return self.group.watch(what, step)

    def watch_step(self, step: int) -> AbstractContextManager[None]:
        """``watch`` around training step ``step``, tightening the timeouts after the first."""
        return self.group.watch_step(step)

    def first_step_done(self) -> None:
        self.group.first_step_done()

    def describe(self, batch_size: int) -> str:
        """One line for the start of a run: ranks, strategy, backend, per-rank batch."""
        world = self.rank.world_size
        return (
            f"{world} ranks, {self.strategy}, {self.group.backend}: train.batch_size {batch_size} is the "
            f"job's batch, {per_rank(batch_size, world)} samples per rank"
        )

    def warnings(self, batch_size: int) -> list[str]:
        """What to warn of once at the start: batch norms that normalize per rank (the job then
        does not train what one process does)."""
        warning = self.batch_norms.warning(batch_size, self.rank.world_size)
        return [warning] if warning is not None else []

    def row(self, batch_size: int) -> dict[str, Any]:
        """The job for ``metrics.jsonl``: ranks, strategy, backend, per-rank batch, batch norms."""
        return {
            "world_size": self.rank.world_size,
            "strategy": self.strategy,
            "backend": self.group.backend,
            "batch_per_rank": batch_size // self.rank.world_size,
            **self.batch_norms.row(),
        }

    def close(self) -> None:
        """Leave the process group (every exit path). Called from a ``finally``: an exception in
        flight is this rank's own failure, told to the other ranks first (``JobGroup.tell_failure``)."""
        failure = sys.exc_info()[1]
        if isinstance(failure, Exception):
            self.group.tell_failure(failure)
        self.group.close()
