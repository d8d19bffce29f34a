"""Split nested training state into tensors (for safetensors) and plain JSON — no pickle anywhere.

``encode`` walks dicts, lists and tuples; each tensor is replaced by ``{"__tensor__": key}``
and collected under that key, everything else must be JSON data (numbers, strings, bools,
None), a tuple, a dict with non-string keys, or a numpy array, each tagged so that ``decode``
restores the same Python types. Anything else is a ``TypeError`` naming its path: a state
that cannot be stored without pickle is refused at save time, not discovered at load time.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_TENSOR, _TUPLE, _ITEMS, _NDARRAY = "__tensor__", "__tuple__", "__items__", "__ndarray__"


def encode(state: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """Return ``(json_data, tensors)``; tensor keys are the ``/``-joined paths in ``state``."""
    tensors: dict[str, torch.Tensor] = {}
    return _encode(state, prefix, tensors), tensors


def decode(data: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of ``encode``; a missing tensor key is a ``KeyError``."""
    if isinstance(data, dict):
        if _TENSOR in data:
            return tensors[data[_TENSOR]]
        if _TUPLE in data:
            return tuple(decode(v, tensors) for v in data[_TUPLE])
        if _ITEMS in data:
            return {decode(k, tensors): decode(v, tensors) for k, v in data[_ITEMS]}
        if _NDARRAY in data:
            return np.asarray(data[_NDARRAY], dtype=data["dtype"])
        return {k: decode(v, tensors) for k, v in data.items()}
    if isinstance(data, list):
        return [decode(v, tensors) for v in data]
    return data


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        key = path or "tensor"
        tensors[key] = obj
        return {_TENSOR: key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _encode(v, f"{path}/{k}" if path else k, tensors) for k, v in obj.items()}
        return {_ITEMS: [[_encode(k, "", {}), _encode(v, f"{path}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, np.ndarray):
        return {_NDARRAY: obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} at '{path}' without pickle; use tensors or plain data")
