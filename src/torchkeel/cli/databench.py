"""``keel data-bench CONFIG [KEY=VALUE ...]``: the worker-count trial's table for a config's training data."""

from __future__ import annotations

import argparse

import torch

from torchkeel.config import load_config
from torchkeel.data.build import data_fingerprint, loader_factory, resolve_data
from torchkeel.data.tune import tune_workers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file (its data and train.batch_size are used)")
    parser.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--trial-s", type=float, default=1.0, help="seconds of loading per candidate (default 1)")
    parser.add_argument("--max-workers", type=int, default=None, help="largest count to try (default: usable CPUs)")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    train_data, _ = resolve_data(cfg.data)
    make = loader_factory(cfg.data, batch_size=cfg.train.batch_size, seed=cfg.seed, device=torch.device("cpu"))
    result = tune_workers(
        lambda n: make(train_data, n),
        fingerprint=data_fingerprint(train_data, cfg.data, cfg.train.batch_size),
        trial_s=args.trial_s,
        limit=args.max_workers,
        least=getattr(train_data, "min_workers", 0),
        use_cache=False,
    )
    if getattr(train_data, "min_workers", 0):
        print(
            f"from {train_data.min_workers} worker: this data is tokenized in the workers, never in the training process"
        )
    print(result.table())
    print(f"best: num_workers={result.num_workers} ({result.reason})")
    return 0
