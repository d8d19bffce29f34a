"""Safetensors files written as a stream and read through a memory map.

Writing: the header is built from the tensors' dtypes and shapes, then each tensor's bytes go
straight from its memory to the file in chunks — no serialized copy of the state is ever made,
and a CUDA tensor is copied to the CPU one tensor at a time. ``safetensors`` itself has no
streaming writer that lets the bytes be hashed on their way out, hence this one; what it writes
is a plain safetensors file (tensors in name order, contiguous, header padded to 8 bytes), and
the tests read it back with the library.

Reading is the library's own: ``safetensors.safe_open`` parses and checks the header and maps
the file, so the tensors are views of the page cache until they are first written to.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

CHUNK_BYTES = 16 * 2**20
DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}


def tensor_file_chunks(tensors: Mapping[str, torch.Tensor]) -> tuple[Iterator[memoryview], int]:
    """The bytes of a safetensors file holding ``tensors``, as chunks, and their total size.

    Raises:
        TypeError: a dtype safetensors cannot hold, naming the tensor.
    """
    names = sorted(tensors)
    header: dict[str, dict] = {}
    offset = 0
    for name in names:
        tensor = tensors[name]
        if tensor.dtype not in DTYPE_NAMES:
            raise TypeError(f"cannot store tensor '{name}' of dtype {tensor.dtype} in safetensors")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    prefix = struct.pack("<Q", len(text)) + text
    return _chunks(prefix, [tensors[n] for n in names]), len(prefix) + offset


def _chunks(prefix: bytes, tensors: list[torch.Tensor]) -> Iterator[memoryview]:
    yield memoryview(prefix)
    for tensor in tensors:
        if tensor.numel() == 0:
            continue
        host = tensor.detach().to("cpu").contiguous()  # a copy only for device or strided tensors
        data = memoryview(host.reshape(-1).view(torch.uint8).numpy())
        for start in range(0, len(data), CHUNK_BYTES):
            yield data[start : start + CHUNK_BYTES]


def load_tensor_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, memory-mapped (copy-on-write).

    Raises:
        Whatever ``safetensors`` raises for a malformed file (the caller names the file).
    """
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}
