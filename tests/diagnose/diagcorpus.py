"""The diagnose corpus: small faulty scripts, clean controls that resemble them, and what
``keel diagnose`` must say about each (``corpus/expected.json``: the id of the finding that must
come first and the evidence it must carry; ``null`` for a clean control)."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from forkrun import ForkRunner

CORPUS = Path(__file__).resolve().parent / "corpus"
EXPECTED: dict[str, dict[str, Any] | None] = json.loads((CORPUS / "expected.json").read_text())
KEEL = [sys.executable, "-m", "torchkeel.cli.main"]


_RUNNER: list[ForkRunner] = []
_RUNNER_LOCK = threading.Lock()


def _forked(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    with _RUNNER_LOCK:
        if not _RUNNER:
            _RUNNER.append(ForkRunner())
            atexit.register(_RUNNER[0].close)
    return _RUNNER[0].run(argv, cwd, env, timeout_s)


def diagnose(
    name: str,
    *extra: str,
    cwd: Path = CORPUS,
    args: tuple[str, ...] = (),
    timeout_s: float = 180,
    fork: bool = True,
) -> tuple[dict[str, Any], int, float]:
    """Run ``keel diagnose --json`` on one script from ``cwd`` (default: the corpus folder):
    (report, exit code, seconds). The script's own output must have gone to stderr.

    ``fork``: in a fork of a process that imported torch already (``forkrun``: a process of its
    own, without the seconds of imports); False: a fresh ``keel`` process (for timings)."""
    start = time.perf_counter()
    argv = ["diagnose", "--json", *extra, "--", "python", name, *args]
    if fork:
        proc = _forked(argv, cwd, {"OMP_NUM_THREADS": "1"}, timeout_s)
    else:
        proc = subprocess.run(
            [*KEEL, *argv],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    elapsed = time.perf_counter() - start
    diagnose.last_stderr = proc.stderr
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"{name}: stdout is not one JSON object ({exc}); stderr: {proc.stderr[-2000:]}") from None
    return report, proc.returncode, elapsed


def diagnose_all(names: list[str], repro_for: set[str] | None = None, workers: int = 2) -> dict[str, tuple]:
    """Diagnose several scripts, two at a time; ``--no-repro`` unless the name is in ``repro_for``
    (None: the default, which checks reproducibility of short runs)."""

    def one(name: str) -> tuple:
        extra = () if repro_for is None or name in repro_for else ("--no-repro",)
        return diagnose(name, *extra)

    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(names, pool.map(one, names)))


def evidence_matches(expected: dict[str, Any], evidence: dict[str, Any]) -> list[str]:
    """What the evidence lacks: a list expected holds items each found in the actual value
    (substring for text); a string must be contained; anything else must be equal."""
    missing = []
    for key, want in expected.items():
        got = evidence.get(key)
        if isinstance(want, list):
            text = json.dumps(got)
            if got is None or (not want and got) or any(json.dumps(w).strip('"') not in text for w in want):
                missing.append(f"{key}: want {want}, got {got}")
        elif isinstance(want, str):
            if not isinstance(got, str) or want not in got:
                missing.append(f"{key}: want {want!r} in {got!r}")
        elif got != want:
            missing.append(f"{key}: want {want!r}, got {got!r}")
    return missing


def verdict(name: str, report: dict[str, Any]) -> tuple[bool, str]:
    """(as expected, why not). A fault passes when its finding comes first with the evidence; a
    clean control passes when it has no error or warning finding (info is only a suspicion)."""
    findings = report["findings"]
    want = EXPECTED[name]
    alarms = [f for f in findings if f["severity"] in ("error", "warning")]
    if want is None:
        return (not alarms, f"false alarm: {[(f['id'], f['message']) for f in alarms]}")
    if not findings:
        return False, f"nothing found, expected {want['id']}"
    first = findings[0]
    if first["id"] != want["id"]:
        return False, f"first finding {first['id']} ({first['message']}), expected {want['id']}"
    missing = evidence_matches(want.get("evidence", {}), first["evidence"])
    return (not missing, f"{want['id']} evidence: {missing}")
