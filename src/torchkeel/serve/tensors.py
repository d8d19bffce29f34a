"""Tensors of the inference protocols: datatypes, raw bytes (Triton's binary layout), base64 and
JSON numbers, decoded or refused with a ``ProtocolError`` that names the field; an input's spec
(``TensorSpec``) and the checks of its values (id ranges, axes shared across inputs). Pure
functions, shared by the v2 (REST and gRPC) and v1 parsers."""

from __future__ import annotations

import base64
import binascii
import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

DTYPES: dict[str, Any] = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BF16": None,
    "BYTES": object,
}
NUMPY_TO_V2 = {np.dtype(v): k for k, v in DTYPES.items() if v not in (None, object)}


class ProtocolError(Exception):
    """A request the server cannot accept: ``status`` is the HTTP code, the message says why.

    ``headers`` go on the error response (``Connection: close`` after an oversized body);
    ``param`` names the request field at fault; ``body`` replaces the usual ``{"error": message}``
    (OpenAI's clients read their own shape).
    """

    def __init__(
        self,
        status: int,
        message: str,
        headers: dict[str, str] | None = None,
        param: str | None = None,
        body: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.headers, self.param, self.body = status, headers, param, body


@dataclass
class TensorSpec:
    name: str
    datatype: str
    shape: list[int]  # -1 for the batch dimension and other dynamic ones
    dims: list[str] | None = None
    """A name per axis; a dynamic axis shares its name with the axes of other inputs that must
    have the same size (``batch``, ``length``). ``None``: only the batch is shared."""
    range: list[int] | None = None
    """``[low, high]``: the values an integer input may hold (token ids of the model's embedding)."""
    max_shape: list[int] | None = None
    """The most each axis may hold (``-1``: no limit): a sequence model's positions."""


def check_values(array: np.ndarray, spec: TensorSpec, where: str) -> None:
    """Sizes and values a model cannot take are a 400 naming the input: an empty axis (a
    ``[1, 0]`` prompt), a sequence longer than the model's positions, an id past its vocabulary."""
    for axis in range(1, array.ndim):
        if array.shape[axis] == 0:
            raise ProtocolError(
                400, f"{where} has shape {list(array.shape)}: axis {axis} is empty; send at least one value there"
            )
        limit = spec.max_shape[axis] if spec.max_shape and axis < len(spec.max_shape) else -1
        if 0 <= limit < array.shape[axis]:
            raise ProtocolError(
                400,
                f"{where} has {array.shape[axis]} values on axis {axis}; the model takes at most {limit} "
                f"(its positions); send a shorter sequence",
            )
    check_range(array, spec, where)


def check_range(array: np.ndarray, spec: TensorSpec, where: str) -> None:
    """An integer input outside its ``range`` (a token id past the model's vocabulary) is a 400."""
    if spec.range is None or array.size == 0 or array.dtype.kind not in "iu":
        return
    low, high = int(array.min()), int(array.max())
    if low < spec.range[0] or high > spec.range[1]:
        value = low if low < spec.range[0] else high
        raise ProtocolError(
            400,
            f"{where} holds {value}, outside [{spec.range[0]}, {spec.range[1]}] (the ids the "
            f"model's embedding has rows for); send ids of the model's vocabulary",
        )


def check_shared_dims(arrays: dict[str, np.ndarray], specs: dict[str, TensorSpec], where: str = "inputs") -> None:
    """Axes that share a name across inputs (a padded sequence's ``length``) must have one size."""
    seen: dict[str, tuple[str, int]] = {}
    for name, array in arrays.items():
        dims = specs[name].dims if name in specs else None
        for axis, dim in enumerate(dims or []):
            if dim == "batch" or axis >= array.ndim:
                continue
            if dim in seen and seen[dim][1] != array.shape[axis]:
                other, size = seen[dim]
                raise ProtocolError(
                    400,
                    f"{where} disagree on '{dim}': '{other}' has {size}, '{name}' has "
                    f"{array.shape[axis]} (axis {axis}); send them of one length",
                )
            seen.setdefault(dim, (name, array.shape[axis]))


def array_from_bytes(chunk: memoryview | bytes, datatype: str, count: int, where: str) -> np.ndarray:
    """``count`` values of ``datatype`` from raw bytes (Triton's layout: BYTES items length-prefixed)."""
    if datatype == "BYTES":
        return _length_prefixed(memoryview(chunk), count, where)
    if datatype == "BF16":
        if len(chunk) != 2 * count:
            raise ProtocolError(400, f"{where}: {len(chunk)} binary bytes for {count} BF16 values (need {2 * count})")
        return torch.frombuffer(bytearray(chunk), dtype=torch.bfloat16).float().numpy()
    dtype = np.dtype(DTYPES[datatype])
    if len(chunk) != dtype.itemsize * count:
        raise ProtocolError(
            400, f"{where}: {len(chunk)} binary bytes for {count} {datatype} values (need {dtype.itemsize * count})"
        )
    return np.frombuffer(chunk, dtype=dtype).copy()


def _length_prefixed(chunk: memoryview, count: int, where: str) -> np.ndarray:
    items, offset = [], 0
    for i in range(count):
        if offset + 4 > len(chunk):
            raise ProtocolError(400, f"{where}: the binary data ends before BYTES item {i} of {count}")
        size = int.from_bytes(chunk[offset : offset + 4], "little")
        if offset + 4 + size > len(chunk):
            raise ProtocolError(
                400, f"{where}: BYTES item {i} declares {size} bytes; {len(chunk) - offset - 4} are left"
            )
        items.append(bytes(chunk[offset + 4 : offset + 4 + size]))
        offset += 4 + size
    if offset != len(chunk):
        raise ProtocolError(400, f"{where}: {len(chunk) - offset} bytes after the {count} BYTES items")
    return object_array(items)


def base64_items(data: Any, where: str) -> np.ndarray:
    """JSON ``data`` of a BYTES input: base64 strings (flat or nested), decoded."""
    flat = data
    while isinstance(flat, list) and flat and isinstance(flat[0], list):
        flat = [v for row in flat for v in (row if isinstance(row, list) else [row])]
    if not isinstance(flat, list):
        raise ProtocolError(400, f"{where}.data must be a list of base64 strings")
    items = []
    for i, item in enumerate(flat):
        if not isinstance(item, str):
            raise ProtocolError(400, f"{where}.data[{i}] must be a base64 string, got {type(item).__name__}")
        items.append(b64decode(item, f"{where}.data[{i}]"))
    return object_array(items)


def b64decode(text: str, where: str) -> bytes:
    """Strict base64 (no stray characters), or a 400 naming ``where``."""
    try:
        if _STRICT_BASE64:
            return binascii.a2b_base64(text, strict_mode=True)  # C, one pass
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(400, f"{where} is not valid base64") from None


_STRICT_BASE64 = sys.version_info >= (3, 11)


def object_array(items: list[bytes]) -> np.ndarray:
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array


def length_prefixed(items: np.ndarray) -> bytes:
    """BYTES items in Triton's binary layout: each a 4-byte little-endian length, then the bytes."""
    return b"".join(len(b).to_bytes(4, "little") + b for b in (as_bytes(v) for v in items.reshape(-1)))


def as_bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def all_finite(array: np.ndarray) -> bool:
    """Whether a numeric array holds no NaN/Inf. For 16/32-bit floats one float64 sum decides it
    (it cannot overflow from finite values of those types), which is cheaper than a mask."""
    if array.dtype.kind != "f":
        return True
    if array.dtype.itemsize <= 4:
        return math.isfinite(np.add.reduce(array, axis=None, dtype=np.float64))
    return bool(np.isfinite(array).all())


def numbers(data: Any, dtype: Any, message: str) -> np.ndarray:
    """``data`` (nested JSON lists of numbers) as an array of ``dtype``, or the 400 ``message``."""
    try:
        return np.asarray(data, dtype=dtype)  # out-of-range floats become inf (with a warning): refused later
    except (TypeError, ValueError, OverflowError, RecursionError):
        raise ProtocolError(400, message) from None


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
