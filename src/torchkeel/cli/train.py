"""``keel train CONFIG [key=value ...]``: train what a YAML config describes."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from torchkeel.checkpoint.faults import parse_fault_rules
from torchkeel.config.load import load_config
from torchkeel.train.trainer import Trainer

HELP = "train the model a YAML config describes (overrides: key=value, e.g. optim.lr=3e-4)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    parser.add_argument("--resume", metavar="auto|PATH",
                        help="continue from the newest valid checkpoint of the run (auto) or from PATH")
    parser.add_argument("--init-from", metavar="PATH",
                        help="start from these weights (checkpoint, .safetensors, .pt); sets model.init_from")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    parser.add_argument("--no-progress", action="store_true", help="print no progress lines")


def run(args: argparse.Namespace) -> int:
    # Console scripts do not put the working directory on sys.path; `python -m` would.
    # Users' import paths (model.target: mymodels:Net) are relative to where they run keel.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    overrides = list(args.overrides) + ([f"model.init_from={args.init_from}"] if args.init_from else [])
    config = load_config(args.config, overrides)
    faults = os.environ.get("TORCHKEEL_TEST_FAULTS")  # test seam, see torchkeel.checkpoint.faults
    trainer = Trainer(
        config, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress,
        checkpoint_hook=parse_fault_rules(faults) if faults else None,
    )
    summary = trainer.fit()
    print(format_summary(summary))
    return exit_code(summary)


def exit_code(summary: dict) -> int:
    """0 completed, 128 + signal number when preempted (143 SIGTERM, 130 SIGINT), else 1."""
    if summary["status"] == "completed":
        return 0
    if summary["status"] == "preempted":
        return 128 + signal.Signals[summary["signal"]].value
    return 1


def format_summary(summary: dict) -> str:
    """One line for a person: status, validation metrics, steps, wall time, run directory."""
    parts = [f"status {summary['status']}"]
    for key in ("val_accuracy", "val_loss"):
        if key in summary:
            parts.append(f"{key} {summary[key]:.4f}")
    parts += [f"steps {summary['steps']}", f"wall {summary['wall_s']:.1f} s", f"run dir {summary['run_dir']}"]
    return " | ".join(parts)
