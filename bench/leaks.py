"""How soon the leak detector reports a kept step output on the wall clock, with the Trainer's
defaults, and that a clean loop of the same length stays quiet.

Not a test: it prints figures (the tests use the process's CPU clock, which a busy machine
cannot stretch). Goal: found within 30 s of training on an idle machine.

    python bench/leaks.py [--seconds 60]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from test_leaks import train_for  # noqa: E402 - the tests' loop, on the wall clock here


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    finding, _, steps = train_for(args.seconds, keep=True, speed=1.0, clock=time.perf_counter)
    found_s = time.perf_counter() - start
    print(
        f"kept step output: {'found' if finding else 'NOT found'} after {found_s:.1f} s, {steps} steps "
        f"(goal: within 30 s){'' if finding and found_s <= 30 else '  <- goal not met'}"
    )
    start = time.perf_counter()
    finding, _, steps = train_for(args.seconds, keep=False, speed=1.0, clock=time.perf_counter)
    print(
        f"clean loop: {'no finding' if finding is None else 'FALSE ALARM'} in {time.perf_counter() - start:.1f} s, "
        f"{steps} steps"
    )


if __name__ == "__main__":
    main()
