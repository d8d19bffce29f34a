"""``keel export RUN_DIR_OR_CHECKPOINT --format torchscript|torch-export|onnx|hf [--out DIR]``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from torchkeel.errors import ConfigError
from torchkeel.export.export import export_pretrained, export_run
from torchkeel.export.formats import FILENAMES, read_model_json
from torchkeel.export.parity import describe


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="run directory (its newest valid checkpoint) or a checkpoint directory")
    parser.add_argument(
        "--format",
        required=True,
        choices=[*FILENAMES, "hf"],
        help="artifact format (hf: a transformers model's save_pretrained directory)",
    )
    parser.add_argument("--out", help="output directory (default: RUN_DIR/export-FORMAT)")
    parser.add_argument("--batch-sizes", default="1,8", help="parity batch sizes, comma-separated (default 1,8)")
    image = parser.add_argument_group(
        "image preprocessing recorded for keel serve (default: the run's data.preprocess)"
    )
    image.add_argument("--image-mode", choices=["RGB", "L"], help="decode images to RGB or grayscale (L)")
    image.add_argument("--resize", help="N: shorter side to N; H,W: to that size")
    image.add_argument("--crop", help="centre crop N or H,W after the resize")
    image.add_argument("--interpolation", choices=["nearest", "bilinear", "bicubic"], help="resize filter (bilinear)")
    image.add_argument("--scale", type=float, help="pixel multiplier before mean/std (default 1/255)")
    image.add_argument("--mean", help="per-channel mean, comma-separated")
    image.add_argument("--std", help="per-channel std, comma-separated")
    parser.add_argument("--labels", help="a text file with one class label per line (default: the dataset's classes)")


def run(args: argparse.Namespace) -> int:
    if os.getcwd() not in sys.path:  # the run's model.target is imported, as for keel train
        sys.path.insert(0, os.getcwd())
    if args.format == "hf":
        out = export_pretrained(args.source, args.out)
        served = (out / "model.json").is_file()
        if served:
            print(describe(read_model_json(out)["parity"]))
        print(
            "wrote a save_pretrained directory (config.json, safetensors"
            + (", tokenizer, model.json for keel serve" if served else "")
            + f") to {out}"
        )
        return 0
    sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    meta = export_run(
        args.source, args.format, args.out, sizes, preprocess=_preprocess(args), labels=_labels(args.labels)
    )
    print(describe(meta["parity"]))
    print(
        f"exported {meta['name']} ({meta['format']}, {meta['weights']} weights of step {meta['step']}) to "
        f"{args.out or 'the run directory'}: {meta['file']}, model.json"
    )
    return 0


def _preprocess(args: argparse.Namespace) -> dict[str, Any] | None:
    """The image preprocess given on the command line, as a spec (None: none given)."""
    given = {
        "resize": args.resize,
        "crop": args.crop,
        "interpolation": args.interpolation,
        "scale": args.scale,
        "mean": args.mean,
        "std": args.std,
    }
    if args.image_mode is None:
        extra = sorted(f"--{k}" for k, v in given.items() if v is not None)
        if extra:
            raise ConfigError(f"{', '.join(extra)} need --image-mode RGB or L")
        return None
    spec: dict[str, Any] = {"mode": args.image_mode}
    for key in ("resize", "crop"):
        if given[key] is not None:
            spec[key] = _numbers(given[key], f"--{key}", int)
    for key in ("mean", "std"):
        if given[key] is not None:
            spec[key] = _numbers(given[key], f"--{key}", float)
    for key in ("interpolation", "scale"):
        if given[key] is not None:
            spec[key] = given[key]
    return spec


def _numbers(text: str, flag: str, kind: type) -> list[Any]:
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated {kind.__name__}s, got {text!r}") from None


def _labels(path: str | None) -> list[str] | None:
    if path is None:
        return None
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(
            f"--labels '{path}' cannot be read ({type(exc).__name__}); give a text file, one label per line"
        ) from None
    return [line.strip() for line in lines if line.strip()]
