"""``keel generate RUN_DIR|EXPORT_DIR --prompt TEXT``: continue a prompt with a trained language model."""

from __future__ import annotations

import argparse
import os
import sys

from torchkeel.export.lm import open_language_model
from torchkeel.lm import generate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a run directory, a checkpoint, or an export (--format hf, onnx, ...)")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument(
        "--max-new-tokens", type=int, help="tokens to add at most (default 64, fewer where the model's positions end)"
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy decoding (default 1.0)")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (default 0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of probability p")
    parser.add_argument("--seed", type=int, help="the same seed gives the same text")
    parser.add_argument("--num-return-sequences", type=int, default=1, help="continuations to print (default 1)")
    parser.add_argument("--stop", action="append", default=[], help="a string that ends the text (repeatable)")
    parser.add_argument("--tokenizer", help="byte or a tokenizer directory, for a model that carries none")


def run(args: argparse.Namespace) -> int:
    if os.getcwd() not in sys.path:  # the run's model.target is imported, as for keel train
        sys.path.insert(0, os.getcwd())
    lm = open_language_model(args.source, args.tokenizer)
    outputs = generate(
        lm.model,
        lm.tokenizer,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        num_return_sequences=args.num_return_sequences,
        stop=args.stop,
        decoder=lm.decoder,
    )
    for index, out in enumerate(outputs):
        if len(outputs) > 1:
            print(f"--- {index + 1} ({out.finish_reason})")
        print(out.prompt + out.text)
    return 0
