"""``keel serve EXPORT_DIR``: serve an export over KServe v2 / Triton REST and KServe v1."""

from __future__ import annotations

import argparse

from torchkeel.serve.app import ServeOptions, serve

HELP = "serve an exported model (KServe v2 / Triton REST with binary tensors, KServe v1, /metrics)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("export_dir", help="directory written by keel export")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-queue-delay-ms", type=float, default=0.0,
                        help="opt-in wait to fill a batch for an idle model from a burst (default 0: greedy)")
    parser.add_argument("--inline-max-ms", type=float, default=10.0,
                        help="forwards faster than this run on the event loop, slower ones on a model thread")
    parser.add_argument("--max-queue", type=int, default=1024, help="queued requests before 503")
    parser.add_argument("--queue-timeout-ms", type=float, default=10_000.0, help="queue wait before 503")
    parser.add_argument("--max-body-mb", type=float, default=16.0)
    parser.add_argument("--allow-nonfinite", action="store_true", help="accept NaN/Inf inputs")
    parser.add_argument("--top-k", type=int, default=None, help="KServe v1: answer with top-k labels and scores")


def run(args: argparse.Namespace) -> int:
    options = ServeOptions(
        max_batch_size=args.max_batch_size, max_queue_delay_ms=args.max_queue_delay_ms, max_queue=args.max_queue,
        queue_timeout_ms=args.queue_timeout_ms, max_body_mb=args.max_body_mb, allow_nonfinite=args.allow_nonfinite,
        top_k=args.top_k, inline_max_ms=args.inline_max_ms,
    )
    print(f"serving {args.export_dir} on http://{args.host}:{args.port} (KServe v2 /v2, v1 /v1, /metrics)", flush=True)
    serve(args.export_dir, args.host, args.port, options)
    return 0
