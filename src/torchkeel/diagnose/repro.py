"""Reproducibility: run the script again in a fresh process and compare its losses step by step.

A fresh process matters: Python's string hashing (set and dict order of strings) is seeded per
process, so only a second process shows a script that depends on it. The second run records
losses only (``python -m torchkeel.diagnose.repro OUT [--steps N] -- script ARGS``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from torchkeel.diagnose.findings import Finding
from torchkeel.diagnose.probe import Facts, Probe
from torchkeel.diagnose.runner import run_script


def record_run(
    script: str, args: list[str], *, steps: int | None, hash_seed: str, timeout_s: float
) -> dict[str, Any] | None:
    """``{"losses", "seeds"}`` of one more run of the script (None if it did not finish in time)."""
    with tempfile.TemporaryDirectory(prefix="keel-repro-") as tmp:
        out = os.path.join(tmp, "losses.json")
        cmd = [
            sys.executable,
            "-m",
            "torchkeel.diagnose.repro",
            out,
            *(["--steps", str(steps)] if steps else []),
            "--",
            script,
            *args,
        ]
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        try:
            subprocess.run(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return None
        if not os.path.exists(out):
            return None
        with open(out) as fh:
            return json.load(fh)


def first_difference(a: list[float], b: list[float]) -> int | None:
    """Index of the first loss that differs (NaN equals NaN), or None when the common prefix agrees."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y and not (x != x and y != y):
            return i
    return None


def check_reproducible(
    script: str, args: list[str], facts: Facts, *, steps: int | None, timeout_s: float
) -> tuple[Finding | None, dict[str, Any]]:
    """Run the script once more and return a ``nondeterministic`` finding if its losses differ.

    When they differ and every random generator the script used was seeded, a third run with the
    same ``PYTHONHASHSEED`` as the second tells string-hash order apart from nondeterministic kernels.
    """
    first = [x["value"] for x in facts.losses]
    summary: dict[str, Any] = {"compared": 0, "runs": 2}
    if not first:
        return None, summary
    run = record_run(script, args, steps=steps, hash_seed="1", timeout_s=timeout_s)
    if run is None:
        summary["skipped"] = "the second run did not finish"
        return None, summary
    second = run["losses"]
    summary["compared"] = min(len(first), len(second))
    index = first_difference(first, second)
    if index is None:
        return None, summary
    calls = facts.seeds.get("calls", [])
    seeded = sorted({c["function"] for c in calls if c["seeded"]})
    nothing_seeded = not seeded
    suspects = _unseeded(facts, calls, run["seeds"], seeded)
    if not suspects:
        third_run = record_run(script, args, steps=steps, hash_seed="1", timeout_s=timeout_s)
        third = third_run["losses"] if third_run else None
        summary["runs"] = 3
        if third is not None and first_difference(second, third) is None and len(third) == len(second):
            suspects.append(
                "the order of a set or dict of strings, which changes with PYTHONHASHSEED "
                "(sort it, or set PYTHONHASHSEED)"
            )
        else:
            suspects.append(
                "nondeterministic kernels, thread scheduling or time-dependent code "
                "(torch.use_deterministic_algorithms(True))"
            )
    step = facts.losses[index]["step"]
    evidence = {
        "first_differing_step": step,
        "backward_index": index,
        "loss_run_1": first[index],
        "loss_run_2": second[index],
        "steps_compared": summary["compared"],
        "seeded": seeded,
        "suspects": suspects,
        "runs": summary["runs"],
        "nothing_seeded": nothing_seeded,
    }
    message = (
        f"two runs of the script differ from step {step} (loss {first[index]:.6g} vs {second[index]:.6g}); "
        f"suspect: {suspects[0]}"
    )
    # A script that seeds nothing makes no promise that two runs agree: their differing is worth
    # saying (info), not an alarm. One that seeds some generators and not others does promise it.
    severity = "error" if seeded else "info"
    fix = (
        "Seed every generator the script uses (random.seed, np.random.seed or a seeded np.random.default_rng, "
        "torch.manual_seed, DataLoader(generator=...)) and avoid iterating over sets."
    )
    return Finding("nondeterministic", severity, message, evidence, fix), summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchkeel.diagnose.repro")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    probe = Probe(max_steps=ns.steps, light=True)
    run_script(ns.script, ns.args, probe)
    with open(ns.out, "w") as fh:
        json.dump(
            {"losses": [x["value"] for x in probe.facts.losses], "seeds": probe.facts.seeds.get("calls", [])},
            fh,
            default=str,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())


def _unseeded(facts: Facts, calls: list[dict[str, Any]], second: list[dict[str, Any]], seeded: list[str]) -> list[str]:
    """What the seed calls of the two runs say could make them differ: generators never seeded,
    seeds that change between runs."""
    suspects = []
    values_1 = [(c["function"], c["value"]) for c in calls]
    values_2 = [(c["function"], c["value"]) for c in second]
    changed = [f"{a[0]}({a[1]!r}) in run 1 but {a[0]}({b[1]!r}) in run 2" for a, b in zip(values_1, values_2) if a != b]
    if not seeded:
        suspects.append(
            "nothing is seeded: torch's global generator (weight initialisation, shuffling, dropout) and every other "
            "generator start from a different state in each run"
        )
    elif "torch.manual_seed" not in seeded:
        suspects.append("torch's global generator is never seeded (torch.manual_seed)")
    if changed:
        suspects.append(f"the seed itself changes between runs (time- or PID-based?): {changed[0]}")
    if facts.seeds.get("random_used") and "random.seed" not in seeded:
        suspects.append("python's random module is used but never seeded (random.seed)")
    if facts.seeds.get("numpy_used") and "numpy.random.seed" not in seeded:
        suspects.append("numpy's global random state is used but never seeded (np.random.seed)")
    unseeded_rng = [c for c in calls if c["function"] == "numpy.random.default_rng" and not c["seeded"]]
    if unseeded_rng:
        site = unseeded_rng[0]["site"] or {}
        suspects.append(f"np.random.default_rng() without a seed at {site.get('file')}:{site.get('line')}")
    return suspects
