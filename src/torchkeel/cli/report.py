"""``keel report RUN_DIR [--out DIR]``: a run as pictures (report.html and PNG charts)."""

from __future__ import annotations

import argparse

from torchkeel.report import build_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory (still going or killed is fine)")
    parser.add_argument("--out", help="output directory (default: the run directory)")


def run(args: argparse.Namespace) -> int:
    report = build_report(args.run_dir, args.out)
    print(f"report: {report.path} ({len(report.images)} charts)")
    for item in report.warnings:
        print(f"warning: {item}")
    for item in report.missing:
        print(f"missing: {item}")
    return 0
