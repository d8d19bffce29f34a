"""Distributed training under torchrun: the process group, DDP/FSDP2 wrapping, gradient sync,
per-rank checkpoint state, and the few decisions every rank must agree on."""

from torchkeel.distributed.agree import (
    agree_all,
    agree_min,
    any_rank,
    any_rank_flags,
    read_finite,
)
from torchkeel.distributed.batchnorm import BatchNormUse, sync_batch_norms
from torchkeel.distributed.group import CollectiveTimeout, JobGroup, default_backend
from torchkeel.distributed.job import TrainingJob
from torchkeel.distributed.parallel import (
    GradSync,
    apply_activation_checkpointing,
    empty_like_batch,
    even_batches,
    resolve_strategy,
    shard_targets,
    unwrap,
    wrap_model,
)
from torchkeel.distributed.rank import RankInfo, per_rank

__all__ = [
    "BatchNormUse",
    "CollectiveTimeout",
    "DataParallel",
    "GradSync",
    "JobGroup",
    "ProcessGroup",
    "RankInfo",
    "TrainingJob",
    "agree_all",
    "agree_min",
    "any_rank",
    "any_rank_flags",
    "apply_activation_checkpointing",
    "default_backend",
    "empty_like_batch",
    "even_batches",
    "per_rank",
    "read_finite",
    "resolve_strategy",
    "shard_targets",
    "sync_batch_norms",
    "unwrap",
    "wrap_model",
]

# The names these had before (they read as torch.nn.DataParallel and torch.distributed.ProcessGroup).
DataParallel = TrainingJob
ProcessGroup = JobGroup
