"""Sharded checkpoints of FSDP2 runs through ``torch.distributed.checkpoint`` (DCP), inside
torchkeel's atomic checkpoint directory.

Every rank writes its own shards of the model and optimizer into ``step-N/shards/`` at the same
time; rank 0 then writes the rest of the state (schedule, RNG of every rank, progress) and, last,
the manifest with the size and hash of every file, shards included. A kill before the manifest
leaves a directory that is never loaded. DCP reshards on load, so a checkpoint written by N ranks
resumes on M. DCP's ``.metadata`` file is a pickle: it is read only after the manifest's hashes
matched, i.e. only files this job wrote are ever unpickled.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchkeel.checkpoint.format import Checkpoint, PointHook, write_checkpoint
from torchkeel.checkpoint.store import CheckpointStore
from torchkeel.errors import CheckpointError, first_line

SHARDS = "shards"


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _is_distributed():
        dist.barrier()


def save_sharded(
    store: CheckpointStore,
    state: Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    step: int,
    epoch: int,
    metrics: Mapping[str, float] | None = None,
    meta: Mapping[str, Any] | None = None,
    hook: PointHook | None = None,
) -> Path:
    """Called by every rank: write this rank's shards, then (rank 0) the rest and the manifest.

    ``state`` is the rest of the training state without ``model``/``optimizer`` (only rank 0's
    is written). Returns the checkpoint directory once it is complete on every rank.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    is_main = not _is_distributed() or dist.get_rank() == 0
    path = store.path_for(step)
    if is_main:
        store.directory.mkdir(parents=True, exist_ok=True)
        if path.exists():
            store._discard(path)  # a stale write of the same step
        (path / SHARDS).mkdir(parents=True)
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(path / SHARDS))
    if is_main:  # DCP returns on rank 0 after every rank's shards and the metadata are written
        manifest = {"step": step, "epoch": epoch, "metrics": dict(metrics or {}), **(meta or {})}
        write_checkpoint(path, state, manifest, hook, shards=SHARDS)
        store.prune()
    _barrier()
    return path


def load_sharded(found: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load a sharded checkpoint's model (and optimizer) into this run, resharded to its ranks.

    Raises:
        CheckpointError: the shards do not match the model (names the first problem).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    assert found.shards is not None
    if optimizer is None:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)  # unused placeholder
    model_state, optim_state = get_state_dict(model, optimizer)
    wanted = {"model": model_state, "optimizer": optim_state}
    try:
        dcp.load(wanted, checkpoint_id=str(found.shards))
    except Exception as exc:  # noqa: BLE001 - DCP raises CheckpointException with every rank's errors
        raise CheckpointError(f"checkpoint '{found.path}' does not fit this model: {first_line(exc)}") from None
    set_state_dict(model, optimizer, model_state_dict=wanted["model"], optim_state_dict=wanted["optimizer"])


def read_full_weights(shards: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's weights of a sharded checkpoint, gathered into one process (no process
    group needed): what ``keel export`` and ``model.init_from`` read."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}  # filled from the metadata (what dcp_to_torch_save does, minus its pickle)
    _load_state_dict(
        state, storage_reader=FileSystemReader(str(shards)), planner=_EmptyStateDictLoadPlanner(), no_dist=True
    )
    model = state.get("model")
    if not isinstance(model, dict):
        raise CheckpointError(f"sharded checkpoint '{shards}' holds no model weights")
    return {key: value for key, value in model.items() if isinstance(value, torch.Tensor)}
