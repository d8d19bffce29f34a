"""``export_run``: a run directory or checkpoint → an exported model, checked, with ``model.json``;
``export_pretrained``: a transformers model's weights back as a ``save_pretrained`` directory."""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from torchkeel.checkpoint import CheckpointStore, load_model_weights, read_checkpoint
from torchkeel.checkpoint.foreign import checkpoint_weights
from torchkeel.checkpoint.store import is_checkpoint_dir
from torchkeel.config.load import load_config
from torchkeel.config.schema import DataConfig
from torchkeel.data.images import ImagePreprocess
from torchkeel.errors import CheckpointError, ConfigError, ParityError
from torchkeel.export.formats import (
    FILENAMES,
    export_model,
    load_exported,
    read_model_json,
)
from torchkeel.export.inputs import max_length, run_inputs
from torchkeel.export.parity import check_parity, describe
from torchkeel.export.signature import ExportModule
from torchkeel.io import write_json_atomic
from torchkeel.lm.tokenizer import SPECIAL_KINDS, run_tokenizer_spec, write_tokenizer
from torchkeel.train.build import build_model
from torchkeel.train.ema import averaged_weights

DATATYPES = {
    torch.float32: "FP32",
    torch.float64: "FP64",
    torch.float16: "FP16",
    torch.bfloat16: "BF16",
    torch.int64: "INT64",
    torch.int32: "INT32",
    torch.int16: "INT16",
    torch.int8: "INT8",
    torch.uint8: "UINT8",
    torch.bool: "BOOL",
}


def export_run(
    source: str | Path,
    fmt: str,
    out_dir: str | Path | None = None,
    batch_sizes: Sequence[int] = (1, 8),
    preprocess: Mapping[str, Any] | None = None,
    labels: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Export the model of a run directory (its newest valid checkpoint) or of a checkpoint.

    Writes ``<out_dir>/model.pt|model.pt2|model.onnx`` and ``model.json`` (default out_dir:
    ``<run_dir>/export-<fmt>``) and returns the ``model.json`` content.

    ``preprocess`` (an image preprocess spec, see ``torchkeel.data.images``) is what the server
    applies to encoded images; by default it is the run's ``data.preprocess``, if set. ``labels``
    name the output classes (default: the training dataset's ``classes``).

    Raises:
        ConfigError: ``preprocess`` is invalid or gives a shape the model does not take, or
            ``labels`` do not match the outputs.
        ParityError: the exported model differs from the eager one (``model.json`` is still
            written, with ``parity.passed: false``, so the report can be read).
    """
    if fmt not in FILENAMES:
        raise ConfigError(f"--format must be one of {', '.join(FILENAMES)}, got {fmt!r}")
    model, checkpoint, run_dir, config, which = trained_model(source)
    inputs = run_inputs(config, model, limit=max(max(batch_sizes), 8))
    module = ExportModule(model, inputs.signature)
    first = inputs.feeds[0]
    out = Path(out_dir) if out_dir is not None else run_dir / f"export-{fmt}"
    out.mkdir(parents=True, exist_ok=True)
    artifact = out / FILENAMES[fmt]
    names, output_name = inputs.signature.names, inputs.signature.output
    example = tuple(t[: min(2, len(t))] for t in first.values())
    export_model(module, example, fmt, artifact, names, inputs.axes, output_name)
    parity = check_parity(
        module,
        load_exported(fmt, artifact, names, output_name),
        first,
        sorted(set(batch_sizes)),
        other_shapes=inputs.other_shapes(),
        output=output_name,
    )
    with torch.inference_mode():
        output = module(*(t[:1] for t in first.values()))
    meta = {
        "name": config.name,
        "format": fmt,
        "file": artifact.name,
        "inputs": _input_specs(inputs),
        "outputs": [
            {"name": output_name, "datatype": DATATYPES[output.dtype], "shape": inputs.output_shape(module, output)}
        ],
        **_serving(inputs, config, output, preprocess, labels),
        "max_batch_size": max(batch_sizes),
        **({"max_length": inputs.max_length} if inputs.max_length is not None else {}),
        "reference": inputs.reference(),
        "parity": parity,
        "checkpoint": str(checkpoint.path),
        "weights": which,
        "step": checkpoint.step,
        "torch_version": torch.__version__,
    }
    spec = run_tokenizer_spec(config)
    if spec is not None and _is_causal_lm(config, output.dim()):
        meta["task"] = "causal-lm"
        meta["tokenizer"] = write_tokenizer(spec, out, inputs.max_length, *_model_token_ids(config, model))
    write_json_atomic(out / "model.json", meta)
    if not parity["passed"]:
        raise ParityError(f"{describe(parity)}; nothing was shipped as good (see {out / 'model.json'})")
    return meta


def _serving(
    inputs: Any, config: Any, output: torch.Tensor, preprocess: Mapping[str, Any] | None, labels: Sequence[str] | None
) -> dict[str, Any]:
    """``model.json``'s ``labels`` and, for one image input, ``preprocess``: what the server applies."""
    names, first = inputs.signature.names, inputs.feeds[0]
    spec = (
        _preprocess(preprocess, config.data, list(first[names[0]].shape[1:]))
        if len(names) == 1
        else _no_preprocess(preprocess, config.data, names)
    )
    names_of_labels = _labels(inputs.train_data, output) if labels is None else _given_labels(labels, output)
    return {"labels": names_of_labels, **({"preprocess": spec} if spec is not None else {})}


class TrainedModel(NamedTuple):
    model: torch.nn.Module
    """In fp32 and eval mode, with the checkpoint's weights (the averaged ones when the run kept an EMA)."""
    checkpoint: Any
    run_dir: Path
    config: Any
    which: str
    """``ema`` or ``model``: which weights were loaded."""


def trained_model(source: str | Path) -> TrainedModel:
    """The model of a run directory (its newest valid checkpoint) or of a checkpoint, with what
    it came from."""
    checkpoint, run_dir = _resolve(Path(source))
    config = load_config(run_dir / "config.yaml")
    model = build_model(config.model)
    ema = checkpoint.state.get("ema") if checkpoint.state else None
    weights = averaged_weights(ema) if ema is not None else checkpoint_weights(checkpoint)
    which = "ema" if ema is not None else "model"
    load_model_weights(model, weights, strict=True, source=f"checkpoint '{checkpoint.path}' ({which} weights)")
    return TrainedModel(model.float().eval(), checkpoint, run_dir, config, which)


def export_pretrained(source: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write a transformers model's trained weights back as a ``save_pretrained`` directory
    (``config.json`` and safetensors; default ``<run_dir>/export-hf``), which ``model.hf.path``,
    transformers' ``from_pretrained`` and the tools built on it load. A causal LM trained on
    text gets its tokenizer files beside it, and a ``model.json`` (parity checked) with which
    ``keel serve`` serves it, decoding with its key/value cache. Returns the directory.

    Raises:
        ConfigError: the run's model is not a transformers model (it has no ``save_pretrained``).
    """
    trained = trained_model(source)
    model, run_dir = trained.model, trained.run_dir
    if not callable(getattr(model, "save_pretrained", None)):
        raise ConfigError(
            f"--format hf writes a transformers model with save_pretrained, and the model of '{run_dir}' is a "
            f"{type(model).__name__}; use --format onnx, torchscript or torch-export"
        )
    out = Path(out_dir) if out_dir is not None else run_dir / "export-hf"
    spec = run_tokenizer_spec(trained.config)
    if spec is not None:  # generate() and pipeline() stop at the run's end-of-text, within its positions
        positions = max_length(model, None)
        tokenizer = write_tokenizer(spec, out, positions, *_model_token_ids(trained.config, model))
        _set_token_ids(model, tokenizer, positions)
    _save_pretrained(model, out)
    if spec is not None and _is_causal_lm(trained.config, output_dims=3):
        _served_pretrained(trained, out, tokenizer)
    return out


def _model_token_ids(config: Any, model: Any) -> tuple[dict[str, Any], str]:
    """The special token ids the user set for the model, and where: the keys given in
    ``model.hf.config`` (not the model type's defaults), or every one that the config of the
    ``model.hf.path`` directory sets."""
    hf = config.model.hf
    keys = [f"{kind}_token_id" for kind in SPECIAL_KINDS]
    if hf is None:
        return {}, "the model's config"
    if hf.config is not None:
        return {k: hf.config[k] for k in keys if hf.config.get(k) is not None}, "model.hf.config"
    ids = {k: getattr(model.config, k, None) for k in keys}
    return {k: v for k, v in ids.items() if v is not None}, f"model.hf.path={hf.path!r} (its config.json)"


def _set_token_ids(model: Any, tokenizer: Mapping[str, Any], positions: int | None) -> None:
    """The model's and its generation config's special token ids are the tokenizer's (an
    end-of-text list that holds the tokenizer's stays), and ``max_length`` its positions."""
    generation = getattr(model, "generation_config", None)
    for kind in SPECIAL_KINDS:
        key, value = f"{kind}_token_id", tokenizer[f"{kind}_id"]
        for config in (model.config, generation) if generation is not None else (model.config,):
            kept = getattr(config, key, None)
            if not (isinstance(kept, list) and value in kept):
                setattr(config, key, value)
    if generation is not None and positions is not None:
        generation.max_length = positions


def _save_pretrained(model: Any, out: Path) -> None:
    """``model.save_pretrained(out)``, each file and folder it writes given the mode a plain
    ``open()``/``mkdir()`` gives, as everything torchkeel writes (transformers writes the weights 0600)."""
    out.mkdir(parents=True, exist_ok=True)
    before = {p: _stamp(p) for p in out.rglob("*")}
    model.save_pretrained(out)
    file_mode, dir_mode = _umask_modes(out)
    for path in out.rglob("*"):
        if _stamp(path) != before.get(path):
            os.chmod(path, dir_mode if path.is_dir() else file_mode)


def _stamp(path: Path) -> tuple[int, int]:
    status = path.stat()
    return status.st_ino, status.st_mtime_ns


def _umask_modes(directory: Path) -> tuple[int, int]:
    """The modes ``open()`` and ``mkdir()`` give in ``directory`` (0666 and 0777 less the
    umask), read from probes rather than by setting the process-wide umask."""
    probe = directory / f".mode-probe-{os.getpid()}"
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        file_mode = stat.S_IMODE(probe.stat().st_mode)
    finally:
        probe.unlink()
    probe.mkdir()
    try:
        return file_mode, stat.S_IMODE(probe.stat().st_mode)
    finally:
        probe.rmdir()


def _input_specs(inputs: Any) -> list[dict[str, Any]]:
    """``model.json``'s inputs: name, datatype, shape (``-1``: dynamic), axis names, id range, most per axis."""
    return [
        {
            "name": name,
            "datatype": DATATYPES[tensor.dtype],
            "shape": inputs.shape(name),
            **({"dims": inputs.dims(name)} if inputs.dims(name) else {}),
            **({"range": inputs.signature.ranges[name]} if name in inputs.signature.ranges else {}),
            **({"max_shape": inputs.max_shape(name)} if inputs.max_shape(name) else {}),
        }
        for name, tensor in inputs.feeds[0].items()
    ]


def _served_pretrained(trained: TrainedModel, out: Path, tokenizer: dict[str, Any]) -> None:
    """``model.json`` for ``keel serve`` of a ``--format hf`` causal LM: the directory is loaded
    back with transformers and checked against the trained model like any export."""
    inputs = run_inputs(trained.config, trained.model, limit=8)
    module = ExportModule(trained.model, inputs.signature)
    names, first = inputs.signature.names, inputs.feeds[0]
    run = load_exported("hf", out / "config.json", names, "logits")
    parity = check_parity(module, run, first, [1, 8], other_shapes=inputs.other_shapes(), output="logits")
    with torch.inference_mode():
        output = module(*(t[:1] for t in first.values()))
    meta = {
        "name": trained.config.name,
        "format": "hf",
        "file": "config.json",
        "inputs": _input_specs(inputs),
        "outputs": [
            {"name": "logits", "datatype": DATATYPES[output.dtype], "shape": inputs.output_shape(module, output)}
        ],
        "max_batch_size": 8,
        **({"max_length": inputs.max_length} if inputs.max_length is not None else {}),
        "task": "causal-lm",
        "tokenizer": tokenizer,
        "parity": parity,
        "checkpoint": str(trained.checkpoint.path),
        "weights": trained.which,
        "step": trained.checkpoint.step,
        "torch_version": torch.__version__,
    }
    write_json_atomic(out / "model.json", meta)
    if not parity["passed"]:
        raise ParityError(f"{describe(parity)}; nothing was shipped as good (see {out / 'model.json'})")


def _is_causal_lm(config: Any, output_dims: int) -> bool:
    """A next-token model: a transformers causal LM, or any model of per-position logits (an
    output of 3 dimensions) trained on text."""
    if config.model.hf is not None:
        return config.model.hf.task == "causal-lm"
    return output_dims == 3


def _resolve(source: Path):
    if is_checkpoint_dir(source):
        return read_checkpoint(source), source.parent.parent
    if (source / "config.yaml").is_file():
        found, problems = CheckpointStore(source / "checkpoints").latest_valid()
        if found is None:
            raise CheckpointError(
                f"run directory '{source}' has no valid checkpoint" + (f" ({problems[0]})" if problems else "")
            )
        return found, source
    raise ConfigError(f"'{source}' is neither a run directory (with config.yaml) nor a checkpoint directory")


def _preprocess(given: Mapping[str, Any] | None, data: DataConfig, input_shape: list[int]) -> dict[str, Any] | None:
    """The preprocess spec to record (given, else the run's), checked against the model's input."""
    if given is not None:
        preprocess, where = ImagePreprocess.from_spec(given, "--preprocess"), "--preprocess"
    elif data.preprocess.mode is not None:
        preprocess, where = (
            ImagePreprocess.from_spec(dataclasses.asdict(data.preprocess), "data.preprocess"),
            "data.preprocess",
        )
    else:
        return None
    shape = preprocess.output_shape
    if shape is None:
        raise ConfigError(
            f"{where} leaves the image size open; give a crop or a resize to [height, width] "
            f"so that every image becomes the model's {input_shape}"
        )
    if shape != input_shape:
        raise ConfigError(
            f"{where} makes images of shape {shape}, but the model takes {input_shape}; change mode, resize or crop"
        )
    return preprocess.to_spec()


def _no_preprocess(given: Mapping[str, Any] | None, data: DataConfig, names: list[str]) -> None:
    """An image preprocess makes the one input of an image model; a model of several inputs has none."""
    if given is not None or data.preprocess.mode is not None:
        raise ConfigError(f"an image preprocess needs a model of one input; this one takes {names}")
    return None


def _given_labels(labels: Sequence[str], output: torch.Tensor) -> list[str]:
    if output.dim() != 2 or len(labels) != output.shape[1]:
        raise ConfigError(
            f"--labels gives {len(labels)} labels, but the model has {list(output.shape[1:])} outputs; "
            f"give one label per output class"
        )
    return [str(label) for label in labels]


def _labels(dataset: Any, output: torch.Tensor) -> list[str] | None:
    dataset = getattr(dataset, "dataset", dataset) if not hasattr(dataset, "classes") else dataset
    labels = getattr(dataset, "classes", None)
    if labels is not None and output.dim() == 2 and len(labels) == output.shape[1]:
        return [str(label) for label in labels]
    return None


__all__ = ["DATATYPES", "export_run", "read_model_json"]
