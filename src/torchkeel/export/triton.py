"""A Triton model repository from an export: ``OUT/<name>/config.pbtxt`` and ``OUT/<name>/1/<model>``.

The config is checked by parsing it into Triton's own ``ModelConfig`` protobuf message (the
``tritonclient`` package ships the generated module), so a typo cannot reach a Triton server.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from torchkeel.errors import ConfigError, MissingExtraError
from torchkeel.export.formats import read_model_json

PLATFORMS = {"torchscript": "pytorch_libtorch", "onnx": "onnxruntime_onnx"}


def write_triton_repo(
    export_dir: str | Path,
    out: str | Path,
    *,
    max_batch_size: int = 64,
    max_queue_delay_us: int = 2000,
    instances: int = 1,
    kind: str = "KIND_CPU",
) -> Path:
    """Write the repository for the export in ``export_dir``; return ``OUT/<name>``."""
    meta = read_model_json(export_dir)
    if meta["format"] not in PLATFORMS:
        raise ConfigError(f"Triton serves torchscript or onnx exports, not {meta['format']}; export with --format onnx")
    if not meta.get("parity", {}).get("passed"):
        raise ConfigError(f"the export in '{export_dir}' failed its parity check; fix and export again")
    model_dir = Path(out) / meta["name"]
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(export_dir) / meta["file"], model_dir / "1" / meta["file"])
    if meta.get("labels"):
        (model_dir / "labels.txt").write_text("\n".join(meta["labels"]) + "\n")
    text = config_pbtxt(
        meta, max_batch_size=max_batch_size, max_queue_delay_us=max_queue_delay_us, instances=instances, kind=kind
    )
    parse_model_config(text)
    (model_dir / "config.pbtxt").write_text(text)
    return model_dir


def config_pbtxt(
    meta: dict[str, Any], *, max_batch_size: int, max_queue_delay_us: int, instances: int, kind: str
) -> str:
    """The ``config.pbtxt`` text. TorchScript tensors follow libtorch's ``name__index`` convention."""
    libtorch = meta["format"] == "torchscript"

    def tensor(spec: dict[str, Any], index: int, label: bool) -> str:
        name = f"{spec['name']}__{index}" if libtorch else spec["name"]
        dims = ", ".join(str(d) for d in spec["shape"][1:])
        extra = '\n    label_filename: "labels.txt"' if label else ""
        return f'  {{\n    name: "{name}"\n    data_type: TYPE_{spec["datatype"]}\n    dims: [ {dims} ]{extra}\n  }}'

    inputs = ",\n".join(tensor(t, i, False) for i, t in enumerate(meta["inputs"]))
    outputs = ",\n".join(tensor(t, i, bool(meta.get("labels"))) for i, t in enumerate(meta["outputs"]))
    return (
        f'name: "{meta["name"]}"\nplatform: "{PLATFORMS[meta["format"]]}"\nmax_batch_size: {max_batch_size}\n'
        f"input [\n{inputs}\n]\noutput [\n{outputs}\n]\n"
        f"dynamic_batching {{\n  max_queue_delay_microseconds: {max_queue_delay_us}\n}}\n"
        f"instance_group [\n  {{\n    count: {instances}\n    kind: {kind}\n  }}\n]\n"
    )


def parse_model_config(text: str) -> Any:
    """Parse ``config.pbtxt`` text into Triton's ``ModelConfig``; a parse error is a ``ConfigError``."""
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        raise MissingExtraError("dev", "tritonclient[grpc]", "checking a Triton config") from None
    try:
        return text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise ConfigError(f"the generated config.pbtxt is not a valid Triton ModelConfig: {exc}") from None
