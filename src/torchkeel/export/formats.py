"""One function per export format, and a loader for each artifact.

Every exported model takes named tensors (``input``, or one per key of a dict batch) with a
dynamic batch dimension — and dynamic sequence dimensions where the data had them — and returns
one tensor. TorchScript uses ``torch.jit.trace`` — the format whose traces hard-code shapes and
control flow, which is exactly what the parity check at several batch sizes is for.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchkeel.errors import ConfigError, MissingExtraError, ParityError

FILENAMES = {"torchscript": "model.pt", "torch-export": "model.pt2", "onnx": "model.onnx"}
MAX_BATCH = 1 << 16


Feed = dict[str, np.ndarray]


def export_model(
    model: torch.nn.Module,
    example: torch.Tensor | tuple[torch.Tensor, ...],
    fmt: str,
    path: Path,
    names: list[str] | None = None,
    axes: dict[str, list[int]] | None = None,
    output: str = "output",
) -> None:
    """Write ``model`` (in eval mode) to ``path`` in format ``fmt``, traced with ``example``.

    ``example`` is one tensor per input, named ``names`` (default ``["input"]``); ``axes``
    names the dynamic axes of each (default: the batch, axis 0). The output is named ``output``.
    """
    model = model.eval()
    example = example if isinstance(example, tuple) else (example,)
    names = names or ["input"]
    axes = axes or {name: [0] for name in names}
    if fmt == "torchscript":
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the tracer's notes on data-dependent shapes
            torch.jit.trace(model, example).save(str(path))
        return
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    per_input = tuple({d: (batch if d == 0 else torch.export.Dim.AUTO) for d in axes[name]} for name in names)
    # A module of one tensor argument takes it as such; ExportModule takes its inputs as *tensors.
    shapes = per_input if _takes_tensors(model) else (per_input,)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # deprecation notices of the exporters themselves
        if fmt == "torch-export":
            program = torch.export.export(model, example, dynamic_shapes=shapes)
            _check_dynamic(program, names, axes)
            torch.export.save(program, str(path))
        elif fmt == "onnx":
            _require("onnxscript", "torch.onnx export")
            with _quiet():
                torch.onnx.export(
                    model,
                    example,
                    str(path),
                    input_names=names,
                    output_names=[output],
                    dynamic_shapes=shapes,
                    dynamo=True,
                    verbose=False,
                )
        else:
            raise ValueError(f"unknown format {fmt!r}; use {', '.join(FILENAMES)}")


def load_exported(
    fmt: str, path: Path, names: list[str] | None = None, output: str = "output"
) -> Callable[[np.ndarray | Feed], np.ndarray]:
    """A function from a numpy batch (one input) or a dict of them by input name to the numpy
    output, running the artifact as a server would."""
    names = names or ["input"]

    def feed_of(batch: np.ndarray | Feed) -> Feed:
        return batch if isinstance(batch, dict) else {names[0]: batch}

    if fmt == "hf":
        return _pretrained_runner(path, names)
    if fmt == "onnx":
        ort = _require("onnxruntime", "running ONNX models")
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        return lambda batch: session.run([output], feed_of(batch))[0]
    module = torch.jit.load(str(path)) if fmt == "torchscript" else torch.export.load(str(path)).module()

    def run(batch: np.ndarray | Feed) -> np.ndarray:
        feed = feed_of(batch)
        with torch.inference_mode():
            return module(*(torch.from_numpy(np.ascontiguousarray(feed[name])) for name in names)).numpy()

    return run


def _pretrained_runner(path: Path, names: list[str]) -> Callable[[np.ndarray | Feed], np.ndarray]:
    """A ``save_pretrained`` causal LM (``path``: its ``config.json``) as a runner of named inputs
    → logits; the model rides along as ``run.model`` (generation uses its cache)."""
    transformers = _require("transformers", "serving a --format hf export")
    directory = path.parent if path.is_file() else path
    fp32 = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch.float32}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, local_files_only=True, use_safetensors=True, trust_remote_code=False, **fp32
    ).eval()

    def run(batch: np.ndarray | Feed) -> np.ndarray:
        feed = batch if isinstance(batch, dict) else {names[0]: batch}
        tensors = {name: torch.from_numpy(np.ascontiguousarray(feed[name])) for name in names}
        with torch.inference_mode():
            return model(**tensors).logits.float().numpy()

    run.model = model  # type: ignore[attr-defined]
    return run


def _check_dynamic(program: torch.export.ExportedProgram, names: list[str], axes: dict[str, list[int]]) -> None:
    """Every axis asked to be dynamic stayed so (``Dim.AUTO`` keeps an axis the code fixes static).

    Raises:
        ParityError: naming the input, the axis and its fixed size — a server would refuse
            every other size.
    """
    nodes = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    for name, node_name in zip(names, program.graph_signature.user_inputs):
        shape = nodes[node_name].meta["val"].shape
        fixed = [(axis, int(shape[axis])) for axis in axes[name] if _is_static(shape[axis])]
        if fixed:
            axis, size = fixed[0]
            raise ParityError(
                f"torch.export fixed axis {axis} of input '{name}' to {size}: the model's code makes it "
                "static (a recurrent layer, a size read as a Python int), so other sizes would fail; "
                "export with --format onnx or torchscript, or make that code shape-generic"
            )


def _is_static(size: int | torch.SymInt) -> bool:
    """An int, or a symbol export specialized to a number."""
    return not isinstance(size, torch.SymInt) or bool(size.node.expr.is_number)


def _takes_tensors(model: torch.nn.Module) -> bool:
    """Whether ``model.forward`` names its parameters (else it takes ``*tensors``)."""
    import inspect

    return not any(
        p.kind is inspect.Parameter.VAR_POSITIONAL for p in inspect.signature(model.forward).parameters.values()
    )


def _require(module: str, feature: str):
    try:
        return __import__(module)
    except ImportError:
        raise MissingExtraError("export", module, feature) from None


@contextlib.contextmanager
def _quiet():
    """The ONNX exporter prints progress and logs warnings about optional packages."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def read_model_json(export_dir: str | Path) -> dict[str, Any]:
    """The ``model.json`` of an export directory.

    Raises:
        ConfigError: missing or unreadable, naming the file.
    """
    path = Path(export_dir) / "model.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"'{path}' not found; pass a directory written by `keel export`") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"'{path}' is unreadable ({type(exc).__name__}); export again") from None
