"""``keel serve EXPORT_DIR [EXPORT_DIR ...]``: serve exports over KServe v2 / Triton REST and gRPC, and KServe v1."""

from __future__ import annotations

import argparse
import sys

from torchkeel.data.images import MAX_PIXELS
from torchkeel.serve.app import ServeOptions, serve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "export_dirs",
        nargs="+",
        metavar="EXPORT_DIR",
        help="directories written by keel export, or directories of them",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind, for HTTP and gRPC (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001, help="KServe v2 / Triton gRPC port (0: no gRPC)")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument(
        "--max-queue-delay-ms",
        type=float,
        default=0.0,
        help="opt-in wait to fill a batch for an idle model from a burst (default 0: greedy)",
    )
    parser.add_argument(
        "--inline-max-ms",
        type=float,
        default=10.0,
        help="forwards faster than this run on the event loop, slower ones on a model thread",
    )
    parser.add_argument("--max-queue", type=int, default=1024, help="queued requests per model before 503")
    parser.add_argument("--queue-timeout-ms", type=float, default=10_000.0, help="queue wait before 503")
    parser.add_argument("--max-body-mb", type=float, default=16.0)
    parser.add_argument("--allow-nonfinite", action="store_true", help="accept NaN/Inf inputs")
    parser.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="KServe v1: answer with top-k labels and scores (image models: 5 by default)",
    )
    parser.add_argument(
        "--max-image-pixels",
        type=int,
        default=MAX_PIXELS,
        help=f"refuse images with more pixels than this (default {MAX_PIXELS:,})",
    )
    parser.add_argument("--image-threads", type=int, default=2, help="threads decoding and preprocessing images")


def run(args: argparse.Namespace) -> int:
    options = ServeOptions(
        max_batch_size=args.max_batch_size,
        max_queue_delay_ms=args.max_queue_delay_ms,
        max_queue=args.max_queue,
        queue_timeout_ms=args.queue_timeout_ms,
        max_body_mb=args.max_body_mb,
        allow_nonfinite=args.allow_nonfinite,
        top_k=args.top_k,
        inline_max_ms=args.inline_max_ms,
        max_image_pixels=args.max_image_pixels,
        image_threads=args.image_threads,
        grpc_port=args.grpc_port,
    )
    grpc = f", gRPC on {args.host}:{args.grpc_port}" if args.grpc_port else ""
    serve(
        args.export_dirs,
        args.host,
        args.port,
        options,
        on_start=lambda repository: _report(repository, f"http://{args.host}:{args.port}{grpc}"),
    )
    return 0


def _report(repository, where: str) -> None:
    for model in repository.models.values():
        kind = "images or tensors" if model.is_image_model else "tensors"
        print(f"serving {model.name} (version {model.version}, {kind}) from {model.path}", flush=True)
    for failed in repository.unavailable:
        print(f"not serving {failed.name} from {failed.path}: {failed.reason}", file=sys.stderr, flush=True)
    print(f"listening on {where} (KServe v2 /v2, v1 /v1, /metrics)", flush=True)
