"""``keel triton-repo EXPORT_DIR OUT``: a Triton model repository from an export."""

from __future__ import annotations

import argparse

from torchkeel.export.triton import write_triton_repo


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("export_dir", help="directory written by keel export (torchscript or onnx)")
    parser.add_argument("out", help="model repository directory")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-queue-delay-us", type=int, default=2000)
    parser.add_argument("--instances", type=int, default=1)
    parser.add_argument("--kind", default="KIND_CPU", choices=["KIND_CPU", "KIND_GPU", "KIND_AUTO"])


def run(args: argparse.Namespace) -> int:
    model_dir = write_triton_repo(
        args.export_dir,
        args.out,
        max_batch_size=args.max_batch_size,
        max_queue_delay_us=args.max_queue_delay_us,
        instances=args.instances,
        kind=args.kind,
    )
    print(f"Triton model repository: {model_dir} (config.pbtxt parsed as ModelConfig)")
    return 0
