"""``keel demo``: train a small CNN on the built-in handwritten digits and print the result."""

from __future__ import annotations

import argparse

from torchkeel.cli.train import exit_code
from torchkeel.demo.digits import export_and_serve_one, run_demo
from torchkeel.export.parity import describe
from torchkeel.report import build_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", default="runs", help="directory for the run (default: runs)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    parser.add_argument("--no-progress", action="store_true", help="print no progress lines")


def run(args: argparse.Namespace) -> int:
    summary = run_demo(args.out_dir, args.overrides, progress=not args.no_progress)
    accuracy = summary.get("val_accuracy", float("nan"))
    print(
        f"digits demo {summary['status']}: validation accuracy {accuracy:.4f} "
        f"(val_loss {summary.get('val_loss', float('nan')):.4f})"
    )
    print(
        f"{summary['steps']} steps, {summary['epochs']} epochs in {summary['wall_s']:.1f} s; "
        f"run directory: {summary['run_dir']}"
    )
    print(
        f"checkpoints: {summary['run_dir']}/checkpoints (atomic, verified; a killed `keel train` "
        "continues with --resume auto)"
    )
    if summary["status"] != "completed":
        return exit_code(summary)
    served = export_and_serve_one(summary["run_dir"])
    print(f"export: {describe(served['parity'])} -> {served['export_dir']}")
    print(
        f"served {served['png']} ({served['url']}, KServe v1 image_bytes): digit {served['predicted']} "
        f"(score {served['score']:.3f}); true label {served['label']}"
    )
    print(f"serve it yourself: keel serve {served['export_dir']}")
    print(f"report: {build_report(summary['run_dir']).path}")
    return exit_code(summary)
