"""Checkpoints: atomic, verified, pickle-free, with exact resume."""

from torchkeel.checkpoint.foreign import load_weights
from torchkeel.checkpoint.format import (
    Checkpoint,
    read_checkpoint,
    snapshot,
    write_checkpoint,
)
from torchkeel.checkpoint.state import (
    capture_rng,
    capture_training_state,
    load_model_weights,
    restore_rng,
    restore_training_state,
)
from torchkeel.checkpoint.store import AsyncSaver, CheckpointStore, is_checkpoint_dir

__all__ = [
    "AsyncSaver",
    "Checkpoint",
    "CheckpointStore",
    "capture_rng",
    "capture_training_state",
    "is_checkpoint_dir",
    "load_model_weights",
    "load_weights",
    "read_checkpoint",
    "restore_rng",
    "restore_training_state",
    "snapshot",
    "write_checkpoint",
]
