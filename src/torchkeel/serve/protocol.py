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
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from torchkeel.errors import first_line
from torchkeel.serve.tensors import (
    DTYPES,
    NUMPY_TO_V2,
    ProtocolError,
    TensorSpec,
    all_finite,
    array_from_bytes,
    as_bytes,
    b64decode,
    base64_items,
    check_shared_dims,
    check_values,
    is_int,
    length_prefixed,
    numbers,
)

HEADER_LENGTH = "Inference-Header-Content-Length"
EXTENSIONS = ["binary_tensor_data", "classification"]


@dataclass
class InferRequest:
    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: dict[str, bool] | None  # requested output → binary; None: all outputs, default encoding
    binary_default: bool
    parameters: dict[str, Any] = field(default_factory=dict)
    classification: dict[str, int] = field(default_factory=dict)  # output → k (Triton's classification extension)


def parse_infer(
    body: bytes,
    header_length: str | None,
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    max_batch_size: int,
    allow_nonfinite: bool = False,
    one_of: bool = False,
) -> InferRequest:
    """Parse and validate a v2 ``infer`` request against the model's input and output specs.

    ``one_of``: the request gives exactly one of ``inputs`` (an image model takes encoded images
    or the preprocessed tensor), instead of all of them.
    """
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
    collected = InputSet(inputs, max_batch_size, allow_nonfinite, one_of)
    offset = 0
    for i, raw in enumerate(raw_inputs):
        where = f"inputs[{i}]"
        if not isinstance(raw, dict):
            raise ProtocolError(400, f"{where} must be an object with name, shape, datatype and data")
        spec, shape = collected.header(where, raw.get("name"), raw.get("datatype"), raw.get("shape"))
        array, offset = _input_array(raw, where, spec, shape, binary, offset)
        collected.add(where, spec, array)
    if offset != len(binary):
        raise ProtocolError(400, f"the body has {len(binary) - offset} bytes after the declared binary inputs")
    binary_default = bool(parameters.get("binary_data_output", False))
    requested, classification = _requested_outputs(doc.get("outputs"), outputs, binary_default)
    return InferRequest(request_id, collected.finish(), requested, binary_default, parameters, classification)


class InputSet:
    """A request's input tensors, checked against the model's specs: the same checks for REST and gRPC."""

    def __init__(
        self, specs: list[TensorSpec], max_batch_size: int, allow_nonfinite: bool, one_of: bool = False
    ) -> None:
        self.specs = {s.name: s for s in specs}
        self.max_batch_size, self.allow_nonfinite, self.one_of = max_batch_size, allow_nonfinite, one_of
        self.arrays: dict[str, np.ndarray] = {}

    def header(self, where: str, name: Any, datatype: Any, shape: Any) -> tuple[TensorSpec, list[int]]:
        """The spec of the input ``name`` and its checked shape; a ProtocolError names what is wrong."""
        if not isinstance(name, str) or name not in self.specs:
            raise ProtocolError(
                400, f"{where}.name {name!r} is not an input of the model; expected {sorted(self.specs)}"
            )
        if name in self.arrays:
            raise ProtocolError(400, f"{where}.name {name!r} is given twice; send each input once")
        spec = self.specs[name]
        if datatype != spec.datatype:
            raise ProtocolError(
                400, f"{where}.datatype is {datatype!r}; the model's '{spec.name}' takes {spec.datatype}"
            )
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise ProtocolError(400, f"{where}.shape must be a list of non-negative integers, got {shape!r}")
        expected = [str(d) if d >= 0 else "N" for d in spec.shape]
        if spec.datatype == "BYTES" and len(shape) == 2 and shape[1] == 1:
            shape = shape[:1]  # [N, 1] encoded items are N items
        if len(shape) != len(spec.shape) or any(d >= 0 and d != s for d, s in zip(spec.shape, shape)):
            raise ProtocolError(
                400, f"{where}.shape is {shape}; the model's '{spec.name}' takes [{', '.join(expected)}]"
            )
        if not 1 <= shape[0] <= self.max_batch_size:
            raise ProtocolError(
                400, f"{where}.shape[0] is {shape[0]}; send between 1 and {self.max_batch_size} samples"
            )
        return spec, shape

    def add(self, where: str, spec: TensorSpec, array: np.ndarray) -> None:
        if not self.allow_nonfinite and not all_finite(array):
            bad = int((~np.isfinite(array)).sum())
            raise ProtocolError(400, f"{where} '{spec.name}' holds {bad} NaN/Inf values; send finite numbers")
        check_values(array, spec, f"{where} '{spec.name}'")
        self.arrays[spec.name] = array

    def finish(self) -> dict[str, np.ndarray]:
        """The arrays by input name, once all are there and agree on the batch size."""
        if self.one_of:
            if len(self.arrays) != 1:
                raise ProtocolError(
                    400, f"send exactly one of the inputs {sorted(self.specs)}, got {sorted(self.arrays)}"
                )
        else:
            missing = sorted(set(self.specs) - set(self.arrays))
            if missing:
                raise ProtocolError(400, f"'inputs' lacks {missing}; the model needs {sorted(self.specs)}")
        sizes = {len(a) for a in self.arrays.values()}
        if len(sizes) > 1:
            raise ProtocolError(400, f"inputs disagree on the batch size: {sorted(sizes)}")
        check_shared_dims({n: a for n, a in self.arrays.items()}, self.specs)
        return self.arrays


def _input_array(
    raw: dict[str, Any], where: str, spec: TensorSpec, shape: list[int], binary: memoryview, offset: int
) -> tuple[np.ndarray, int]:
    count = int(np.prod(shape))
    datatype = spec.datatype
    params = _parameters(raw, f"{where}.parameters")
    if "binary_data_size" in params:
        size = params["binary_data_size"]
        if not is_int(size) or size < 0 or offset + size > len(binary):
            raise ProtocolError(
                400,
                f"{where}.parameters.binary_data_size {size!r} does not fit the "
                f"{len(binary) - offset} binary bytes left",
            )
        chunk = binary[offset : offset + size]
        array = array_from_bytes(chunk, datatype, count, where)
        return array.reshape(shape), offset + size
    if "data" not in raw:
        raise ProtocolError(400, f"{where} has neither 'data' nor parameters.binary_data_size")
    if datatype == "BF16":
        raise ProtocolError(400, f"{where}: BF16 tensors must be sent as binary data")
    if datatype == "BYTES":
        array = base64_items(raw["data"], where)
    else:
        array = numbers(raw["data"], DTYPES[datatype], f"{where}.data holds values that are not {datatype}")
    if array.size != count:
        raise ProtocolError(400, f"{where}.data has {array.size} values; shape {shape} needs {count}")
    return array.reshape(shape), offset


def classification(outputs: np.ndarray, labels: list[str] | None, k: int) -> np.ndarray:
    """Triton's classification extension: per row, the ``k`` largest values as ``"value:index[:label]"``."""
    best = np.argsort(-outputs, axis=1, kind="stable")[:, :k]
    rows = [[f"{outputs[i, j]:f}:{j}" + (f":{labels[j]}" if labels else "") for j in row] for i, row in enumerate(best)]
    array = np.empty((len(rows), k), dtype=object)
    for i, row in enumerate(rows):
        array[i, :] = [r.encode() for r in row]
    return array


def _requested_outputs(
    raw: Any, outputs: list[TensorSpec], binary_default: bool
) -> tuple[dict[str, bool] | None, dict[str, int]]:
    """The outputs asked for (name → binary) and those asked as classifications (name → k)."""
    if raw is None:
        return None, {}
    if not isinstance(raw, list):
        raise ProtocolError(400, "'outputs' must be a list of {name, parameters}")
    requested, classes = {}, {}
    for i, item in enumerate(raw):
        name = item.get("name") if isinstance(item, dict) else None
        params = _parameters(item, f"outputs[{i}].parameters") if isinstance(item, dict) else {}
        requested[checked_output(name, f"outputs[{i}]", outputs)] = bool(params.get("binary_data", binary_default))
        if "classification" in params:
            classes[name] = checked_classification(params["classification"], f"outputs[{i}]", outputs)
    return requested, classes


def checked_output(name: Any, where: str, outputs: list[TensorSpec]) -> str:
    known = {o.name for o in outputs}
    if not isinstance(name, str) or name not in known:
        raise ProtocolError(400, f"{where}.name {name!r} is not an output of the model; expected {sorted(known)}")
    return name


def checked_classification(k: Any, where: str, outputs: list[TensorSpec]) -> int:
    num_classes = outputs[0].shape[-1] if len(outputs[0].shape) == 2 else 0
    if not is_int(k) or not 1 <= k <= max(num_classes, 1) or num_classes <= 0:
        raise ProtocolError(
            400,
            f"{where}.parameters.classification must be an integer from 1 to {num_classes} "
            f"(the model's classes), got {k!r}",
        )
    return k


def encode_infer(
    model: str, version: str, request: InferRequest, results: dict[str, np.ndarray]
) -> tuple[bytes, dict[str, str]]:
    """The response body and extra headers; binary outputs follow the JSON header."""
    wanted = request.outputs if request.outputs is not None else {n: request.binary_default for n in results}
    entries, chunks = [], []
    for name, binary in wanted.items():
        array = np.ascontiguousarray(results[name])
        datatype = "BYTES" if array.dtype == object else NUMPY_TO_V2[array.dtype]
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if binary:
            data = length_prefixed(array) if datatype == "BYTES" else array.tobytes()
            entry["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        elif datatype == "BYTES":
            entry["data"] = [as_bytes(v).decode("utf-8", "replace") for v in array.reshape(-1)]
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


def parse_v1_instances(body: bytes, max_batch_size: int) -> tuple[list[Any], dict[str, Any]]:
    """A KServe v1 body → its ``instances`` (checked: a non-empty list within the batch limit) and ``parameters``."""
    doc = _json_object(body)
    instances = doc.get("instances")
    if not isinstance(instances, list) or not instances:
        raise ProtocolError(400, "'instances' must be a non-empty list, one entry per sample")
    if len(instances) > max_batch_size:
        raise ProtocolError(400, f"'instances' has {len(instances)} entries; send at most {max_batch_size}")
    return instances, _parameters(doc, "parameters")


def v1_tensor(instances: list[Any], spec: TensorSpec, allow_nonfinite: bool = False) -> np.ndarray:
    """v1 instances of numbers → the batch, checked against the model's input ``spec``."""
    _refuse_nulls_and_booleans(instances, "instances")
    array = numbers(
        instances,
        DTYPES[spec.datatype],
        f"'instances' must be numbers of shape {spec.shape[1:]} each (ragged or non-numeric)",
    )
    wanted = spec.shape[1:]
    if array.ndim != len(spec.shape) or any(d >= 0 and d != s for d, s in zip(wanted, array.shape[1:])):
        raise ProtocolError(400, f"each instance has shape {list(array.shape[1:])}; the model takes {spec.shape[1:]}")
    if not allow_nonfinite and not all_finite(array):
        raise ProtocolError(400, "'instances' hold NaN/Inf values; send finite numbers")
    check_values(array, spec, "'instances'")
    return array


_NUMBER_TYPES = {float, int}  # exactly: bool is an int subclass, and is refused


def _refuse_nulls_and_booleans(values: Any, where: str) -> None:
    """numpy reads JSON ``null`` as NaN and ``true`` as 1.0: name the value instead."""
    if isinstance(values, list):
        if set(map(type, values)) <= _NUMBER_TYPES:  # the request path: one pass in C, no generator
            return
        for i, value in enumerate(values):
            _refuse_nulls_and_booleans(value, f"{where}[{i}]")
    elif values is None or isinstance(values, bool):
        kind = "null" if values is None else "a boolean"
        raise ProtocolError(400, f"{where} is {kind}; send a number (a missing value has no number: fill it)")


def v1_has_images(instances: list[Any]) -> bool:
    """Whether v1 instances are encoded images (``{"image_bytes": {"b64": ...}}`` or ``{"b64": ...}``)."""
    return isinstance(instances[0], dict) and ("image_bytes" in instances[0] or "b64" in instances[0])


def v1_named_tensors(
    instances: list[Any], specs: list[TensorSpec], allow_nonfinite: bool = False
) -> dict[str, np.ndarray]:
    """v1 instances of a model of named inputs, ``[{name: values, ...}, ...]`` → the batch by name.

    Every instance gives every input; the values of one input must have one shape across the
    request (sequences of one length: pad them), which the model's spec accepts.
    """
    names = [spec.name for spec in specs]
    for i, instance in enumerate(instances):
        if not isinstance(instance, dict):
            raise ProtocolError(
                400, f"instances[{i}] must be an object of the model's inputs {names}, got {type(instance).__name__}"
            )
        missing, unknown = sorted(set(names) - set(instance)), sorted(set(instance) - set(names))
        if missing or unknown:
            what = "; ".join(
                part
                for part in (f"lacks {missing}" if missing else "", f"has no such inputs {unknown}" if unknown else "")
                if part
            )
            raise ProtocolError(400, f"instances[{i}] {what}; the model takes {names}")
    arrays = {}
    for spec in specs:
        first = np.shape(instances[0][spec.name])
        for i, instance in enumerate(instances[1:], start=1):
            if np.shape(instance[spec.name]) != first:
                raise ProtocolError(
                    400,
                    f"instances[{i}].{spec.name} has shape {list(np.shape(instance[spec.name]))}, "
                    f"instances[0].{spec.name} {list(first)}; send values of one shape in a "
                    "request (pad sequences to one length)",
                )
        array = numbers(
            [instance[spec.name] for instance in instances],
            DTYPES[spec.datatype],
            f"instances[*].{spec.name} must be numbers of type {spec.datatype}",
        )
        wanted = spec.shape[1:]
        if array.ndim != len(spec.shape) or any(d >= 0 and d != s for d, s in zip(wanted, array.shape[1:])):
            shown = ["N" if d < 0 else d for d in wanted]
            raise ProtocolError(
                400, f"instances[*].{spec.name} has shape {list(array.shape[1:])} each; the model takes {shown}"
            )
        if not allow_nonfinite and not all_finite(array):
            raise ProtocolError(400, f"instances[*].{spec.name} hold NaN/Inf values; send finite numbers")
        check_values(array, spec, f"instances[*].{spec.name}")
        arrays[spec.name] = array
    check_shared_dims(arrays, {spec.name: spec for spec in specs}, "instances")
    return arrays


def v1_images(instances: list[Any]) -> tuple[list[bytes], list[str]]:
    """v1 image instances → the encoded images and where each was (for errors).

    Each instance is ``{"image_bytes": {"b64": "..."}}`` (the TF Serving / KServe convention) or
    ``{"b64": "..."}``.
    """
    images, wheres = [], []
    for i, instance in enumerate(instances):
        where = f"instances[{i}]"
        value = instance.get("image_bytes", instance) if isinstance(instance, dict) else None
        if isinstance(instance, dict) and "image_bytes" in instance:
            where += ".image_bytes"
        if not isinstance(value, dict) or not isinstance(value.get("b64"), str):
            raise ProtocolError(400, f'{where} must be {{"image_bytes": {{"b64": "<base64 of an encoded image>"}}}}')
        images.append(b64decode(value["b64"], f"{where}.b64"))
        wheres.append(where)
    return images, wheres


def v1_top_k(parameters: dict[str, Any], default: int | None, num_classes: int) -> int | None:
    """``parameters.top_k`` of a v1 request (or the server's default), checked against the classes."""
    k = parameters.get("top_k", default)
    if k is not None and (not is_int(k) or not 1 <= k <= num_classes):
        raise ProtocolError(400, f"parameters.top_k must be an integer from 1 to {num_classes}, got {k!r}")
    return k


def top_k(outputs: np.ndarray, labels: list[str] | None, k: int) -> list[dict[str, Any]]:
    """Per row, the ``k`` best classes by softmax probability, with their labels."""
    logits = outputs.astype(np.float64)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    best = np.argsort(-probs, axis=1)[:, :k]
    names = labels or [str(i) for i in range(outputs.shape[1])]
    return [
        {"labels": [names[j] for j in row], "scores": [float(probs[i, j]) for j in row]} for i, row in enumerate(best)
    ]


def label_scores(outputs: np.ndarray, labels: list[str] | None, k: int) -> list[list[dict[str, Any]]]:
    """Per row, the ``k`` best classes by softmax probability as ``[{"label", "score"}, ...]``."""
    ranked = top_k(outputs, labels, k)
    return [[{"label": label, "score": score} for label, score in zip(r["labels"], r["scores"])] for r in ranked]


def _json_object(data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except RecursionError:
        raise ProtocolError(
            400, "the request body is nested too deeply to parse; send tensors as flat 'data' lists with a 'shape'"
        ) from None
    except ValueError as exc:  # also UnicodeDecodeError, and integers past Python's digit limit
        raise ProtocolError(400, f"the request body is not valid JSON ({first_line(exc)})") from None
    if not isinstance(doc, dict):
        raise ProtocolError(400, f"the request body must be a JSON object, got {type(doc).__name__}")
    return doc


def _parameters(doc: dict[str, Any], where: str) -> dict[str, Any]:
    params = doc.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ProtocolError(400, f"'{where}' must be an object, got {type(params).__name__}")
    return params
