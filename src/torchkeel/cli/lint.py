"""``keel lint [--json] [--preview] [--select CODES] [--ignore CODES] PATHS...``: static checks of PyTorch code."""

from __future__ import annotations

import argparse
import json

from torchkeel.errors import ConfigError
from torchkeel.lint import RULES, Skipped, lint_paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", help="Python files or directories")
    parser.add_argument("--json", action="store_true", help='print {"findings": [...]} on stdout')
    parser.add_argument("--preview", action="store_true", help="also run the preview rules (see docs/lint.md)")
    parser.add_argument(
        "--select", help="comma-separated codes or prefixes to run (default: all; a preview rule only by its code)"
    )
    parser.add_argument("--ignore", help="comma-separated codes or prefixes to skip")


def codes(text: str | None) -> list[str] | None:
    return [c.strip().upper() for c in text.split(",") if c.strip()] if text else None


def _skipped(skipped: list[Skipped]) -> str:
    if not skipped:
        return ""
    first = skipped[0]
    return f"; {len(skipped)} skipped, not Python (first: {first.path}:{first.line}: {first.reason})"


def run(args: argparse.Namespace) -> int:
    for option, value in (("--select", codes(args.select)), ("--ignore", codes(args.ignore))):
        unknown = [c for c in value or [] if not any(code.startswith(c) for code in RULES)]
        if unknown:
            raise ConfigError(f"{option}: unknown rule code(s) {', '.join(unknown)}; see `docs/lint.md` for TK101..")
    report = lint_paths(args.paths, select=codes(args.select), ignore=codes(args.ignore), preview=args.preview)
    if args.json:
        findings = [f.to_dict() for f in report.findings]
        skipped = [s.to_dict() for s in report.skipped]
        print(json.dumps({"findings": findings, "files": report.files, "skipped": skipped}))
    else:
        for f in report.findings:
            print(f"{f.path}:{f.line}:{f.col}: {f.code} [{f.severity}] {f.message} (fix: {f.fix})")
        print(f"{len(report.findings)} finding(s) in {report.files} file(s){_skipped(report.skipped)}")
    return 1 if any(f.severity == "error" for f in report.findings) else 0
