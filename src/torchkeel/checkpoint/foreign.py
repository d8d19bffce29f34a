"""Load weights from elsewhere (``--init-from``) without ever running code from the file.

A torchkeel checkpoint directory or a ``.safetensors`` file is read without pickle. A
``.pt``/``.pth`` file goes through ``torch.load(weights_only=True)`` only: a file that needs
any other global to unpickle is refused with an error naming that global.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import safetensors.torch
import torch

from torchkeel.checkpoint.format import Checkpoint, read_checkpoint
from torchkeel.checkpoint.sharded import read_full_weights
from torchkeel.checkpoint.store import is_checkpoint_dir
from torchkeel.errors import CheckpointError, first_line

_GLOBAL = re.compile(r"GLOBAL (\S+)")
# Common wrappers of a state dict in other people's checkpoints.
_WRAPPER_KEYS = ("state_dict", "model_state_dict", "model")


def checkpoint_weights(found: Checkpoint) -> dict[str, torch.Tensor]:
    """The model weights of a verified checkpoint; an FSDP run's are gathered from its shards."""
    if found.shards is not None:
        return read_full_weights(found.shards)
    return found.state["model"]


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A model state dict from a torchkeel checkpoint, a safetensors file or a ``.pt``/``.pth`` file.

    Raises:
        CheckpointError: missing file, corrupt file, a pickle that needs disallowed globals,
            or content that holds no state dict.
    """
    p = Path(path)
    if p.is_dir():
        if not is_checkpoint_dir(p):
            raise CheckpointError(f"'{p}' is a directory but not a torchkeel checkpoint (no manifest.json)")
        return checkpoint_weights(read_checkpoint(p))
    if not p.is_file():
        raise CheckpointError(f"weights file '{p}' not found")
    if p.suffix == ".safetensors":
        try:
            return safetensors.torch.load(p.read_bytes())
        except Exception as exc:  # noqa: BLE001 - several error types for bad headers
            raise CheckpointError(f"'{p}' is not a valid safetensors file ({type(exc).__name__})") from None
    return _load_pickled_weights(p)


def _load_pickled_weights(p: Path) -> dict[str, torch.Tensor]:
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        match = _GLOBAL.search(str(exc))
        if match is None:
            raise CheckpointError(f"'{p}' is not a readable torch file ({first_line(exc)})") from None
        raise CheckpointError(
            f"refusing to load '{p}': unpickling it needs the disallowed global '{match.group(1)}', which "
            "could run code. Convert it to a plain state dict or safetensors where it came from"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointError(f"'{p}' is not a readable torch file ({type(exc).__name__}: {first_line(exc)})") from None
    for key in _WRAPPER_KEYS:
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"'{p}' holds no state dict of tensors (found {type(obj).__name__})")
    return obj
