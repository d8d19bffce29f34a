"""One function per export format, and a loader for each artifact.

Every exported model takes one tensor ``input`` with a dynamic batch dimension and returns one
tensor ``output``. TorchScript uses ``torch.jit.trace`` — the format whose traces hard-code
shapes and control flow, which is exactly what the parity check at several batch sizes is for.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from torchkeel.errors import MissingExtraError

FILENAMES = {"torchscript": "model.pt", "torch-export": "model.pt2", "onnx": "model.onnx"}
MAX_BATCH = 1 << 16


def export_model(model: torch.nn.Module, example: torch.Tensor, fmt: str, path: Path) -> None:
    """Write ``model`` (in eval mode) to ``path`` in format ``fmt``, traced with ``example``."""
    model = model.eval()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # deprecation notices of the exporters themselves
        if fmt == "torchscript":
            torch.jit.trace(model, example).save(str(path))
        elif fmt == "torch-export":
            batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
            torch.export.save(torch.export.export(model, (example,), dynamic_shapes=({0: batch},)), str(path))
        elif fmt == "onnx":
            _require("onnxscript", "torch.onnx export")
            batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
            with _quiet():
                torch.onnx.export(
                    model, (example,), str(path), input_names=["input"], output_names=["output"],
                    dynamic_shapes=({0: batch},), dynamo=True, verbose=False,
                )
        else:
            raise ValueError(f"unknown format {fmt!r}; use {', '.join(FILENAMES)}")


def load_exported(fmt: str, path: Path) -> Callable[[np.ndarray], np.ndarray]:
    """A function from a numpy batch to the numpy output, running the artifact as a server would."""
    if fmt == "onnx":
        ort = _require("onnxruntime", "running ONNX models")
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        return lambda batch: session.run(["output"], {"input": batch})[0]
    module = torch.jit.load(str(path)) if fmt == "torchscript" else torch.export.load(str(path)).module()

    def run(batch: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return module(torch.from_numpy(batch)).numpy()

    return run


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
