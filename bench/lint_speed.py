"""Speed of ``keel lint`` on a tree of your choosing, in seconds per 1,000 files.

Not a test: it prints figures. Interleaved rounds of one process and of the default (one
process per usable CPU), on the same files; the goal (issue 55) is <= 15 s per 1,000 files on
2 cores with the default.

    python bench/lint_speed.py PATH [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from torchkeel.lint import lint_paths, python_files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a directory of Python code (a cloned repository)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    num_files = len(python_files([args.path]))
    times: dict[str, list[float]] = {"one process": [], "default": []}
    for _ in range(args.rounds):
        for name, workers in (("one process", 1), ("default", None)):
            start = time.perf_counter()
            report = lint_paths([args.path], workers=workers)
            times[name].append(time.perf_counter() - start)
    print(f"{num_files} files ({report.files} linted, {len(report.skipped)} skipped), {len(report.findings)} findings")
    for name, values in times.items():
        per_1000 = statistics.median(values) / max(num_files, 1) * 1000
        print(f"{name:12s} median {statistics.median(values):7.1f} s   {per_1000:6.1f} s per 1,000 files")
    print("goal: default <= 15 s per 1,000 files on 2 cores")


if __name__ == "__main__":
    main()
