"""``keel export RUN_DIR_OR_CHECKPOINT --format torchscript|torch-export|onnx [--out DIR]``."""

from __future__ import annotations

import argparse
import os
import sys

from torchkeel.export.export import export_run
from torchkeel.export.formats import FILENAMES
from torchkeel.export.parity import describe

HELP = "export a trained model, check parity with the eager model, write model.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="run directory (its newest valid checkpoint) or a checkpoint directory")
    parser.add_argument("--format", required=True, choices=list(FILENAMES), help="artifact format")
    parser.add_argument("--out", help="output directory (default: RUN_DIR/export-FORMAT)")
    parser.add_argument("--batch-sizes", default="1,8", help="parity batch sizes, comma-separated (default 1,8)")


def run(args: argparse.Namespace) -> int:
    if os.getcwd() not in sys.path:  # the run's model.target is imported, as for keel train
        sys.path.insert(0, os.getcwd())
    sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    meta = export_run(args.source, args.format, args.out, sizes)
    print(describe(meta["parity"]))
    print(f"exported {meta['name']} ({meta['format']}, {meta['weights']} weights of step {meta['step']}) to "
          f"{args.out or 'the run directory'}: {meta['file']}, model.json")
    return 0
