"""``keel diagnose`` figures, measured in one run. Not a test: it prints figures.

1. Overhead on healthy scripts (the corpus's clean controls): wall time of
   ``keel diagnose --json -- python script.py`` (instrumented run plus the reproducibility
   run it does by default) against ``python script.py``, interleaved rounds, median of the
   per-round ratios per script. Goal: <= 3x.
2. The whole corpus once: faults named first with their evidence, false alarms on the clean
   controls, and each case's time against 3x its plain run time plus a few seconds.

    python bench/diagnose.py [--rounds 3] [--skip-corpus]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "diagnose"))

from diagcorpus import CORPUS, EXPECTED, diagnose, verdict  # noqa: E402

SLACK_S = 5.0  # "plus a few seconds": interpreter, torch import and the report


def plain(name: str) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, name], cwd=CORPUS, capture_output=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-corpus", action="store_true")
    args = parser.parse_args()
    controls = sorted(n for n, e in EXPECTED.items() if e is None)
    print(f"1. overhead on {len(controls)} healthy scripts, {args.rounds} interleaved rounds")
    ratios = []
    for name in controls:
        per_round, plains, diags = [], [], []
        for _ in range(args.rounds):
            p = plain(name)
            _, _, d = diagnose(name, fork=False)
            per_round.append(d / p)
            plains.append(p)
            diags.append(d)
        ratio = statistics.median(per_round)
        ratios.append(ratio)
        print(
            f"   {name:28s} plain {statistics.median(plains):5.2f} s  diagnose {statistics.median(diags):5.2f} s  "
            f"ratio {ratio:4.2f}"
        )
    print(f"   median ratio {statistics.median(ratios):.2f}, max {max(ratios):.2f} (goal <= 3)")
    if args.skip_corpus:
        return
    print(f"2. the corpus, {len(EXPECTED)} scripts")
    named = alarms = over = 0
    faults = [n for n, e in EXPECTED.items() if e is not None]
    for name in sorted(EXPECTED):
        p = plain(name)
        report, _, d = diagnose(name, fork=False)
        ok, why = verdict(name, report)
        if EXPECTED[name] is None:
            alarms += not ok
        else:
            named += ok
        within = d <= 3 * p + SLACK_S
        over += not within
        first = report["findings"][0]["id"] if report["findings"] else "-"
        print(
            f"   {name:32s} {'ok ' if ok else 'BAD'} first={first:34s} plain {p:5.2f} s  diagnose {d:5.2f} s"
            f"  {d / p:4.2f}x{'' if within else '  OVER 3x+5s'}" + ("" if ok else f"  ({why})")
        )
    print(
        f"   faults named first with evidence: {named}/{len(faults)} ({named / len(faults):.0%}); "
        f"false alarms: {alarms}/{len(EXPECTED) - len(faults)}; cases over 3x plain + {SLACK_S:g} s: {over}"
    )


if __name__ == "__main__":
    main()
