"""``keel``: parse the command line, call the library, map errors to exit codes.

Exit codes: 0 success, 1 a run that failed, 2 a usage or config error, 130 interrupted.
Errors print one line; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence

from torchkeel import __version__
from torchkeel.cli import databench, demo, diagnose, doctor, export, lint, report, serve, train, triton_repo
from torchkeel.errors import KeelError

# Subcommand name → module with add_arguments(parser) and run(args) -> int.
COMMANDS = {"train": train, "demo": demo, "export": export, "triton-repo": triton_repo, "serve": serve, "doctor": doctor, "report": report,
            "data-bench": databench, "diagnose": diagnose, "lint": lint}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keel", description="torchkeel: steady PyTorch training.")
    parser.add_argument("--version", action="version", version=f"torchkeel {__version__}")
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show tracebacks for errors")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module in COMMANDS.items():
        command = sub.add_parser(name, parents=[debug], help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``keel``'s arguments. ``KEY=VALUE`` overrides may stand anywhere after the
    subcommand, before or after its flags (``keel train cfg.yaml --overwrite train.max_epochs=9``)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
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
