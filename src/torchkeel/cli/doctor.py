"""``keel doctor [--json] [--run-dir DIR]``: will PyTorch work here, and fast?"""

from __future__ import annotations

import argparse
import json

from torchkeel.env import collect_facts, run_checks

SCHEMA_VERSION = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON (schema in docs/doctor.md)")
    parser.add_argument("--run-dir", help="also check this run directory (disk, permissions, its config)")
    parser.add_argument("--nproc", type=int, metavar="N", help="check N ranks per node against the visible GPUs")


def run(args: argparse.Namespace) -> int:
    facts = collect_facts(args.run_dir, nproc=args.nproc)
    findings = run_checks(facts)
    failed = any(f.status == "fail" for f in findings)
    if args.json:
        print(
            json.dumps(
                {
                    "schema_version": SCHEMA_VERSION,
                    "ok": not failed,
                    "checks": [f.to_dict() for f in findings],
                    "facts": facts.to_dict(),
                },
                indent=2,
            )
        )
    else:
        width = max(len(f.check) for f in findings)
        for f in findings:
            print(f"{f.status.upper():4s}  {f.check:{width}s}  {f.evidence}")
            if f.fix and f.status != "ok":
                print(f"{'':4s}  {'':{width}s}  fix: {f.fix}")
        print("doctor: " + ("a check failed" if failed else "nothing failed"))
    return 1 if failed else 0
