"""``keel diagnose [--json] [--steps N] [--timeout S] [--compile] [--repro] -- python train.py ARGS``."""

from __future__ import annotations

import argparse
import json
import os
import sys

from torchkeel.diagnose import diagnose_script
from torchkeel.diagnose.report import human_report
from torchkeel.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--steps", type=int, help="stop after N optimizer steps")
    parser.add_argument("--timeout", type=float, help="stop after S seconds")
    parser.add_argument("--compile", action="store_true", help="report torch.compile graph breaks and recompiles")
    repro = parser.add_mutually_exclusive_group()
    repro.add_argument(
        "--repro",
        action="store_true",
        default=None,
        help="run the script twice and compare (default: when it runs under 30 s)",
    )
    repro.add_argument("--no-repro", dest="repro", action="store_false", help="never run it a second time")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- python train.py [ARGS...]")


def script_and_args(command: list[str]) -> tuple[str, list[str]]:
    """``[--] [python] script.py ARGS`` → (script, ARGS)."""
    words = command[1:] if command[:1] == ["--"] else list(command)
    if words and os.path.basename(words[0]).startswith("python"):
        words = words[1:]
    if words[:1] == ["-u"]:
        words = words[1:]
    if not words or not words[0].endswith(".py"):
        raise ConfigError("keel diagnose needs a script: keel diagnose [--json] -- python train.py [ARGS...]")
    return words[0], words[1:]


def run(args: argparse.Namespace) -> int:

    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {args.steps}")
    if args.timeout is not None and args.timeout <= 0:
        raise ConfigError(f"--timeout must be above 0 seconds, got {args.timeout}")
    script, script_args = script_and_args(args.command)
    # The script's own prints go to stderr so that stdout holds only the report.
    stdout_fd = os.dup(1)
    sys.stdout.flush()
    os.dup2(2, 1)
    try:
        diagnosis = diagnose_script(
            script, script_args, steps=args.steps, timeout_s=args.timeout, repro=args.repro, compile=args.compile
        )
    finally:
        sys.stdout.flush()
        os.dup2(stdout_fd, 1)
        os.close(stdout_fd)
    if args.json:
        print(json.dumps(diagnosis.to_dict(), default=str))
    else:
        print(human_report(diagnosis))
    return 1 if diagnosis.has_errors else 0
