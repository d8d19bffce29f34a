"""Batches of any shape: tensors, tuples, lists, dicts and dataclasses of tensors, nested.

The Trainer never looks inside a batch except through these helpers: how many samples it holds,
moving it to a device, and cutting or joining it along the batch dimension.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from torchkeel.errors import DataError


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor of a (nested) batch, keeping its structure."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(b, fn) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(b, fn) for b in batch)
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(
            batch, **{f.name: map_tensors(getattr(batch, f.name), fn) for f in dataclasses.fields(batch) if f.init}
        )
    return batch


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in a (nested) batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    return map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


def tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor of a (nested) batch, in order."""
    found: list[torch.Tensor] = []
    map_tensors(batch, found.append)
    return found


def num_samples(batch: Any) -> int:
    """Samples in a batch: the first dimension of the target of an ``(input, target)`` pair, else
    of the first tensor with a batch dimension (dicts, dataclasses, several inputs)."""
    if isinstance(batch, (list, tuple)) and len(batch) == 2 and not isinstance(batch[1], (dict, list, tuple)):
        for part in (batch[1], batch[0]):
            if isinstance(part, torch.Tensor) and part.dim() > 0:
                return part.shape[0]
    for t in tensors(batch):
        if t.dim() > 0:
            return t.shape[0]
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[-1], (list, tuple)):
        return len(batch[-1])
    raise DataError(
        f"cannot tell the batch size of a {type(batch).__name__} batch: it holds no tensor with a "
        "batch dimension; yield tensors, or tuples/dicts/dataclasses of tensors"
    )


def num_tokens(batch: Any) -> int:
    """Token positions in a batch of token ids: the size of its ``input_ids`` (padding included,
    as transformers counts them); 0 for any other batch."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    return ids.numel() if isinstance(ids, torch.Tensor) else 0


def split_batch(batch: Any, size: int) -> list[Any]:
    """Cut every tensor of a (nested) batch along dim 0 into pieces of at most ``size`` samples.
    Values that are not tensors (strings, numbers) are repeated in every piece."""
    n = num_samples(batch)
    starts = range(0, n, size)
    return [
        map_tensors(batch, lambda t, s=s: t[s : s + size] if t.dim() > 0 and t.shape[0] == n else t) for s in starts
    ]


def concat(pieces: Sequence[Any]) -> Any:
    """Join batches of the same structure along dim 0 (the inverse of ``split_batch``)."""
    first = pieces[0]
    if len(pieces) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(pieces)
    if isinstance(first, (list, tuple)):
        return type(first)(concat([p[i] for p in pieces]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: concat([p[k] for p in pieces]) for k in first}
    return first


def take(batch: Any, index: torch.Tensor | slice) -> Any:
    """The rows ``index`` of every tensor of a (nested) batch."""
    return map_tensors(batch, lambda t: t[index])
