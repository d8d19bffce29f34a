"""``keel``: parse the command line, call the library, map errors to exit codes.

Exit codes: 0 success, 1 a run that failed, 2 a usage or config error, 130 interrupted.
Errors print one line; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from collections.abc import Sequence

from torchkeel._version import __version__
from torchkeel.errors import KeelError

# Subcommand → (module of torchkeel.cli with add_arguments(parser) and run(args) -> int, help).
# Only the module of the command given is imported: `keel lint` and `keel --version` never load
# torch, and `keel serve` loads no training code.
COMMANDS = {
    "train": ("train", "train the model a YAML config describes (overrides: key=value, e.g. optim.lr=3e-4)"),
    "demo": ("demo", "train a small CNN on scikit-learn's handwritten digits (runs again and again into OUT_DIR/demo)"),
    "lr-find": ("lrfind", "the learning-rate range test: train a copy at rising rates, plot the loss, suggest a rate"),
    "export": ("export", "export a trained model, check parity with the eager model, write model.json"),
    "generate": ("generate", "continue a prompt with a trained language model (a run or an export), greedy or sampled"),
    "triton-repo": (
        "triton_repo",
        "write a Triton model repository (config.pbtxt validated against Triton's ModelConfig)",
    ),
    "serve": ("serve", "serve exported models (KServe v2 / Triton REST and gRPC, KServe v1, images, /metrics)"),
    "doctor": ("doctor", "check the environment: versions, CUDA driver vs runtime, libraries, shm, start method, disk"),
    "report": ("report", "turn a run's metrics, incidents and summary into report.html with charts"),
    "data-bench": (
        "databench",
        "time data loading with 0, 1, 2, ... workers on a config's training data and print the table",
    ),
    "diagnose": (
        "diagnose",
        "run an unmodified PyTorch script under instrumentation and name the root cause of what goes wrong",
    ),
    "lint": ("lint", "check PyTorch training code for known bugs without running it (TK1xx rules)"),
    "k8s": ("k8s", "write Kubernetes manifests: k8s train (Kubeflow TrainJob/PyTorchJob), k8s serve (KServe or plain)"),
    "slurm": ("slurm", "write (and with --submit submit) an sbatch script that trains on N Slurm nodes with torchrun"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``keel`` parser; ``command``'s own arguments are added (its module imported) only for it."""
    parser = argparse.ArgumentParser(prog="keel", description="torchkeel: steady PyTorch training.")
    parser.add_argument("--version", action="version", version=f"torchkeel {__version__}")
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks for errors")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, parents=[debug], help=text, description=text)
        if name == command:
            module = importlib.import_module(f"torchkeel.cli.{module_name}")
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(run=module.run)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``keel``'s arguments. ``KEY=VALUE`` overrides may stand anywhere after the
    subcommand, before or after its flags (``keel train cfg.yaml --overwrite train.max_epochs=9``)."""
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(next((w for w in words if not w.startswith("-")), None))
    args, extra = parser.parse_known_args(words)
    overrides = [a for a in extra if "=" in a and not a.startswith("-")]
    unknown = [a for a in extra if a not in overrides]
    if overrides and not hasattr(args, "overrides"):
        unknown = extra
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``keel``; returns the exit code."""
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.run(args)
    except KeelError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"keel: error: {'; '.join([str(exc), *getattr(exc, '__notes__', [])])}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("keel: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
