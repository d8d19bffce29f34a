"""Open Inference Protocol v2 (KServe v2 / Triton REST) and KServe v1 — parsing and encoding only.

Pure functions over bytes and numpy arrays: no server, no model. Every client mistake is a
``ProtocolError`` with an HTTP status and a message that names the field and what was expected.
The binary tensor data extension follows Triton: the JSON header's length is given by the
``Inference-Header-Content-Length`` HTTP header, tensors follow it back to back, each input
declares ``parameters.binary_data_size``, and outputs come back in binary when asked with
``parameters.binary_data`` (per output) or ``binary_data_output`` (per request).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from torchkeel.errors import first_line

DTYPES: dict[str, Any] = {
    "BOOL": np.bool_, "UINT8": np.uint8, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
    "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64, "BF16": None,
}
NUMPY_TO_V2 = {np.dtype(v): k for k, v in DTYPES.items() if v is not None}
HEADER_LENGTH = "Inference-Header-Content-Length"


class ProtocolError(Exception):
    """A request the server cannot accept: ``status`` is the HTTP code, the message says why.

    ``headers`` go on the error response (``Connection: close`` after an oversized body).
    """

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers


@dataclass
class TensorSpec:
    name: str
    datatype: str
    shape: list[int]  # -1 for the batch dimension


@dataclass
class InferRequest:
    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: dict[str, bool] | None  # requested output → binary; None: all outputs, default encoding
    binary_default: bool
    parameters: dict[str, Any] = field(default_factory=dict)


def parse_infer(body: bytes, header_length: str | None, inputs: list[TensorSpec], outputs: list[TensorSpec],
                max_batch_size: int, allow_nonfinite: bool = False) -> InferRequest:
    """Parse and validate a v2 ``infer`` request against the model's input and output specs."""
    if header_length is not None:
        try:
            length = int(header_length)
        except ValueError:
            raise ProtocolError(400, f"{HEADER_LENGTH} must be an integer, got {header_length!r}") from None
        if not 0 <= length <= len(body):
            raise ProtocolError(400, f"{HEADER_LENGTH} {length} is outside the body's {len(body)} bytes")
        header, binary = body[:length], memoryview(body)[length:]
    else:
        header, binary = body, memoryview(b"")
    doc = _json_object(header)
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ProtocolError(400, f"'id' must be a string, got {type(request_id).__name__}")
    parameters = _parameters(doc, "parameters")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise ProtocolError(400, "'inputs' must be a non-empty list of tensors")
    specs = {s.name: s for s in inputs}
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for i, raw in enumerate(raw_inputs):
        where = f"inputs[{i}]"
        if not isinstance(raw, dict):
            raise ProtocolError(400, f"{where} must be an object with name, shape, datatype and data")
        name = raw.get("name")
        if not isinstance(name, str) or name not in specs:
            raise ProtocolError(400, f"{where}.name {name!r} is not an input of the model; expected {sorted(specs)}")
        array, offset = _input_array(raw, where, specs[name], binary, offset, max_batch_size)
        if not allow_nonfinite and not all_finite(array):
            bad = int((~np.isfinite(array)).sum())
            raise ProtocolError(400, f"{where} '{name}' holds {bad} NaN/Inf values; send finite numbers")
        if name in arrays:
            raise ProtocolError(400, f"{where}.name {name!r} is given twice; send each input once")
        arrays[name] = array
    if offset != len(binary):
        raise ProtocolError(400, f"the body has {len(binary) - offset} bytes after the declared binary inputs")
    missing = sorted(set(specs) - set(arrays))
    if missing:
        raise ProtocolError(400, f"'inputs' lacks {missing}; the model needs {sorted(specs)}")
    sizes = {a.shape[0] for a in arrays.values()}
    if len(sizes) > 1:
        raise ProtocolError(400, f"inputs disagree on the batch size: {sorted(sizes)}")
    binary_default = bool(parameters.get("binary_data_output", False))
    return InferRequest(request_id, arrays, _requested_outputs(doc.get("outputs"), outputs, binary_default),
                        binary_default, parameters)


def _input_array(raw: dict[str, Any], where: str, spec: TensorSpec, binary: memoryview, offset: int,
                 max_batch_size: int) -> tuple[np.ndarray, int]:
    datatype = raw.get("datatype")
    if datatype != spec.datatype:
        raise ProtocolError(400, f"{where}.datatype is {datatype!r}; the model's '{spec.name}' takes {spec.datatype}")
    shape = raw.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ProtocolError(400, f"{where}.shape must be a list of non-negative integers, got {shape!r}")
    expected = [str(d) if d >= 0 else "N" for d in spec.shape]
    if len(shape) != len(spec.shape) or any(d >= 0 and d != s for d, s in zip(spec.shape, shape)):
        raise ProtocolError(400, f"{where}.shape is {shape}; the model's '{spec.name}' takes [{', '.join(expected)}]")
    if not 1 <= shape[0] <= max_batch_size:
        raise ProtocolError(400, f"{where}.shape[0] is {shape[0]}; send between 1 and {max_batch_size} samples")
    count = int(np.prod(shape))
    params = _parameters(raw, f"{where}.parameters")
    if "binary_data_size" in params:
        size = params["binary_data_size"]
        if not _is_int(size) or size < 0 or offset + size > len(binary):
            raise ProtocolError(400, f"{where}.parameters.binary_data_size {size!r} does not fit the "
                                     f"{len(binary) - offset} binary bytes left")
        chunk = binary[offset: offset + size]
        array = _from_bytes(chunk, datatype, count, where)
        return array.reshape(shape), offset + size
    if "data" not in raw:
        raise ProtocolError(400, f"{where} has neither 'data' nor parameters.binary_data_size")
    if datatype == "BF16":
        raise ProtocolError(400, f"{where}: BF16 tensors must be sent as binary data")
    array = _numbers(raw["data"], DTYPES[datatype], f"{where}.data holds values that are not {datatype}")
    if array.size != count:
        raise ProtocolError(400, f"{where}.data has {array.size} values; shape {shape} needs {count}")
    return array.reshape(shape), offset


def _from_bytes(chunk: memoryview, datatype: str, count: int, where: str) -> np.ndarray:
    if datatype == "BF16":
        if len(chunk) != 2 * count:
            raise ProtocolError(400, f"{where}: {len(chunk)} binary bytes for {count} BF16 values (need {2 * count})")
        return torch.frombuffer(bytearray(chunk), dtype=torch.bfloat16).float().numpy()
    dtype = np.dtype(DTYPES[datatype])
    if len(chunk) != dtype.itemsize * count:
        raise ProtocolError(400, f"{where}: {len(chunk)} binary bytes for {count} {datatype} values "
                                 f"(need {dtype.itemsize * count})")
    return np.frombuffer(chunk, dtype=dtype).copy()


def _requested_outputs(raw: Any, outputs: list[TensorSpec], binary_default: bool) -> dict[str, bool] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise ProtocolError(400, "'outputs' must be a list of {name, parameters}")
    known = {o.name for o in outputs}
    requested = {}
    for i, item in enumerate(raw):
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or name not in known:
            raise ProtocolError(400, f"outputs[{i}].name {name!r} is not an output of the model; expected {sorted(known)}")
        params = _parameters(item, f"outputs[{i}].parameters")
        requested[name] = bool(params.get("binary_data", binary_default))
    return requested


def encode_infer(model: str, version: str, request: InferRequest, results: dict[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
    """The response body and extra headers; binary outputs follow the JSON header."""
    wanted = request.outputs if request.outputs is not None else {n: request.binary_default for n in results}
    entries, chunks = [], []
    for name, binary in wanted.items():
        array = np.ascontiguousarray(results[name])
        entry: dict[str, Any] = {"name": name, "datatype": NUMPY_TO_V2[array.dtype], "shape": list(array.shape)}
        if binary:
            data = array.tobytes()
            entry["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        else:
            entry["data"] = array.reshape(-1).tolist()
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": entries}
    if request.id is not None:
        doc["id"] = request.id
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not chunks:
        return header, {}
    return header + b"".join(chunks), {HEADER_LENGTH: str(len(header))}


def parse_v1(body: bytes, spec: TensorSpec, max_batch_size: int, allow_nonfinite: bool = False) -> tuple[np.ndarray, dict[str, Any]]:
    """A KServe v1 ``{"instances": [...]}`` body → the input batch and the request's parameters."""
    doc = _json_object(body)
    instances = doc.get("instances")
    if not isinstance(instances, list) or not instances:
        raise ProtocolError(400, "'instances' must be a non-empty list, one entry per sample")
    if len(instances) > max_batch_size:
        raise ProtocolError(400, f"'instances' has {len(instances)} entries; send at most {max_batch_size}")
    array = _numbers(instances, DTYPES[spec.datatype],
                     f"'instances' must be numbers of shape {spec.shape[1:]} each (ragged or non-numeric)")
    if list(array.shape[1:]) != spec.shape[1:]:
        raise ProtocolError(400, f"each instance has shape {list(array.shape[1:])}; the model takes {spec.shape[1:]}")
    if not allow_nonfinite and not all_finite(array):
        raise ProtocolError(400, "'instances' hold NaN/Inf values; send finite numbers")
    return array, _parameters(doc, "parameters")


def v1_top_k(parameters: dict[str, Any], default: int | None, num_classes: int) -> int | None:
    """``parameters.top_k`` of a v1 request (or the server's default), checked against the classes."""
    k = parameters.get("top_k", default)
    if k is not None and (not _is_int(k) or not 1 <= k <= num_classes):
        raise ProtocolError(400, f"parameters.top_k must be an integer from 1 to {num_classes}, got {k!r}")
    return k


def top_k(outputs: np.ndarray, labels: list[str] | None, k: int) -> list[dict[str, Any]]:
    """Per row, the ``k`` best classes by softmax probability, with their labels."""
    logits = outputs.astype(np.float64)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    best = np.argsort(-probs, axis=1)[:, :k]
    names = labels or [str(i) for i in range(outputs.shape[1])]
    return [{"labels": [names[j] for j in row], "scores": [float(probs[i, j]) for j in row]} for i, row in enumerate(best)]


def _json_object(data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except RecursionError:
        raise ProtocolError(400, "the request body is nested too deeply to parse; send tensors as flat "
                                 "'data' lists with a 'shape'") from None
    except ValueError as exc:  # also UnicodeDecodeError, and integers past Python's digit limit
        raise ProtocolError(400, f"the request body is not valid JSON ({first_line(exc)})") from None
    if not isinstance(doc, dict):
        raise ProtocolError(400, f"the request body must be a JSON object, got {type(doc).__name__}")
    return doc


def all_finite(array: np.ndarray) -> bool:
    """Whether a numeric array holds no NaN/Inf. For 16/32-bit floats one float64 sum decides it
    (it cannot overflow from finite values of those types), which is cheaper than a mask."""
    if array.dtype.kind != "f":
        return True
    if array.dtype.itemsize <= 4:
        return math.isfinite(np.add.reduce(array, axis=None, dtype=np.float64))
    return bool(np.isfinite(array).all())


def _parameters(doc: dict[str, Any], where: str) -> dict[str, Any]:
    params = doc.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ProtocolError(400, f"'{where}' must be an object, got {type(params).__name__}")
    return params


def _numbers(data: Any, dtype: Any, message: str) -> np.ndarray:
    """``data`` (nested JSON lists of numbers) as an array of ``dtype``, or the 400 ``message``."""
    try:
        return np.asarray(data, dtype=dtype)  # out-of-range floats become inf (with a warning): refused later
    except (TypeError, ValueError, OverflowError, RecursionError):
        raise ProtocolError(400, message) from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
