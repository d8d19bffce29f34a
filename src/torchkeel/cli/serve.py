"""``keel serve EXPORT_DIR [EXPORT_DIR ...]``: serve exports over KServe v2 / Triton REST and gRPC, and KServe v1."""

from __future__ import annotations

import argparse
import os
import sys

from torchkeel.data.images import MAX_PIXELS
from torchkeel.errors import ConfigError
from torchkeel.serve.app import ServeOptions, serve
from torchkeel.serve.kserve import LOCAL, is_kserve, kserve_defaults


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "export_dirs",
        nargs="*",
        metavar="EXPORT_DIR",
        help="directories written by keel export, or directories of them (under KServe: /mnt/models)",
    )
    parser.add_argument("--host", help="address to bind, for HTTP and gRPC (default 127.0.0.1; under KServe 0.0.0.0)")
    parser.add_argument(
        "--port",
        "--http_port",
        "--http-port",
        dest="port",
        type=int,
        help="HTTP port (default 8000; 8080 under KServe)",
    )
    parser.add_argument(
        "--grpc-port",
        "--grpc_port",
        dest="grpc_port",
        type=int,
        help="gRPC port, 0: none (default 8001; 8081 under KServe)",
    )
    parser.add_argument(
        "--read-timeout-s",
        type=_seconds,
        default=30.0,
        help="each HTTP request must arrive in full (headers and body) within this time, else 408 and the "
        "connection is closed; each gRPC call's request message likewise, else DEADLINE_EXCEEDED; inference "
        "and responses are not bounded by it (default 30)",
    )
    _batching_arguments(parser)
    _input_arguments(parser)
    parser.add_argument(
        "--warmup-batch-sizes",
        type=_sizes,
        default=None,
        metavar="N,N,...|none",
        help="batch sizes each model runs once before it is ready (default 1, 2, 4, ... up to --max-batch-size)",
    )
    parser.add_argument("--model_name", "--model-name", dest="model_name", help="serve the one export under this name")


def _batching_arguments(parser: argparse.ArgumentParser) -> None:
    """How requests are batched, queued and run."""
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


def _input_arguments(parser: argparse.ArgumentParser) -> None:
    """What a request may hold, and how images in it are read."""
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
    place = kserve_defaults(os.environ) if is_kserve(os.environ) else LOCAL
    args.host = args.host or place.host
    args.port = place.http_port if args.port is None else args.port
    args.grpc_port = place.grpc_port if args.grpc_port is None else args.grpc_port
    args.export_dirs = args.export_dirs or place.model_dirs
    if not args.export_dirs:
        raise ConfigError("keel serve needs an EXPORT_DIR (a directory written by keel export)")
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
        warmup_batch_sizes=args.warmup_batch_sizes,
        model_name=args.model_name,
        read_timeout_s=args.read_timeout_s,
    )
    grpc = f", gRPC on {args.host}:{args.grpc_port}" if args.grpc_port else ""
    started = []

    def on_start(repository) -> None:
        started.append(repository)
        from torchkeel.testing import slow_forwards_from_env  # a test seam: unset, nothing happens

        slow_forwards_from_env(repository.models.values())
        _report(repository, f"http://{args.host}:{args.port}{grpc}")

    serve(args.export_dirs, args.host, args.port, options, on_start=on_start)
    if started:
        answered, failed, unanswered = started[0].metrics.answered()
        print(
            f"keel: stopped; answered {answered} requests ({failed} with an error), {unanswered} unanswered",
            file=sys.stderr,
        )
    return 0


def _report(repository, where: str) -> None:
    for model in repository.models.values():
        kind = "images or tensors" if model.is_image_model else "tensors"
        print(f"serving {model.name} (version {model.version}, {kind}) from {model.path}", flush=True)
    for failed in repository.unavailable:
        print(f"not serving {failed.name} from {failed.path}: {failed.reason}", file=sys.stderr, flush=True)
    for note in repository.notes():  # once, at start: e.g. an LM export that does not scale with streams
        print(f"note: {note}", file=sys.stderr, flush=True)
    print(f"listening on {where} (KServe v2 /v2, v1 /v1, /metrics)", flush=True)


def _seconds(text: str) -> float:
    """A positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _sizes(text: str) -> tuple[int, ...]:
    """``1,8,64`` or ``none`` (no warm-up)."""
    if text.strip().lower() in ("none", "0", ""):
        return ()
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of batch sizes (or none)") from None
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return sizes
