"""``keel lr-find CONFIG [KEY=VALUE ...] [--min 1e-7] [--max 1] [--steps 100] [--plot PATH] [--apply]``."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from torchkeel.config.load import load_config
from torchkeel.errors import ConfigError
from torchkeel.train.lrfind import find_lr, plot


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the run's YAML config")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as for keel train")
    parser.add_argument("--min", type=float, default=1e-7, dest="min_lr", help="first learning rate (1e-7)")
    parser.add_argument("--max", type=float, default=1.0, dest="max_lr", help="last learning rate (1)")
    parser.add_argument("--steps", type=int, default=100, help="steps from --min to --max (100)")
    parser.add_argument("--plot", default="lr_find.png", help="the PNG of loss against learning rate (lr_find.png)")
    parser.add_argument("--apply", action="store_true", help="write the suggested rate into CONFIG as optim.lr")


def run(args: argparse.Namespace) -> int:
    if os.getcwd() not in sys.path:  # the config's model.target is imported, as for keel train
        sys.path.insert(0, os.getcwd())
    config = load_config(args.config, args.overrides)
    found = find_lr(config, min_lr=args.min_lr, max_lr=args.max_lr, steps=args.steps)
    print(found.describe())
    print(f"plot: {plot(found, args.plot)}")
    if found.suggestion is None:
        return 1
    rate = f"{found.suggestion:.2e}"
    print(f"keel train {args.config} {' '.join([*args.overrides, f'optim.lr={rate}'])}")
    if args.apply:
        set_lr(Path(args.config), rate)
        print(f"wrote optim.lr: {rate} into {args.config}")
    return 0


def set_lr(path: Path, rate: str) -> None:
    """Set ``optim.lr`` in the YAML file at ``path``, keeping its other lines (and comments) as they are.

    Handles ``optim: {lr: ...}`` on one line, an ``optim:`` block, and a config without either;
    the file is read back to check the edit, and left as it was when the check fails.
    """
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    edited = _edit(lines, rate)
    path.write_text("".join(edited))
    try:
        ok = load_config(path).optim.lr == float(rate)
    except ConfigError:
        ok = False
    if not ok:
        path.write_text(text)
        raise ConfigError(f"could not set optim.lr in '{path}' by editing it; set optim.lr: {rate} by hand")


def _edit(lines: list[str], rate: str) -> list[str]:
    for i, line in enumerate(lines):
        flow = re.match(r"^optim:\s*\{(.*)\}\s*(#.*)?$", line.rstrip("\n"))
        if flow:
            inner = flow.group(1)
            if re.search(r"(^|,)\s*lr\s*:", inner):
                inner = re.sub(r"((?:^|,)\s*lr\s*:\s*)[^,}]+", lambda m: f"{m.group(1)}{rate}", inner)
            else:
                inner = f"lr: {rate}, {inner.strip()}" if inner.strip() else f"lr: {rate}"
            comment = f"  {flow.group(2)}" if flow.group(2) else ""
            return [*lines[:i], f"optim: {{{inner}}}{comment}\n", *lines[i + 1 :]]
        if re.match(r"^optim:\s*(#.*)?$", line.rstrip("\n")):
            block_end = i + 1
            while block_end < len(lines) and (lines[block_end].startswith((" ", "\t")) or not lines[block_end].strip()):
                block_end += 1
            for j in range(i + 1, block_end):
                found = re.match(r"^(\s+lr\s*:\s*)([^#\n]*?)(\s*#.*)?$", lines[j].rstrip("\n"))
                if found:
                    lines[j] = f"{found.group(1)}{rate}{found.group(3) or ''}\n"
                    return lines
            indent = re.match(r"^(\s+)", lines[i + 1]).group(1) if i + 1 < block_end and lines[i + 1].strip() else "  "
            return [*lines[: i + 1], f"{indent}lr: {rate}\n", *lines[i + 1 :]]
    tail = "" if not lines or lines[-1].endswith("\n") else "\n"
    return [*lines, f"{tail}optim:\n  lr: {rate}\n"]
