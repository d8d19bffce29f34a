"""Running ``keel`` as a subprocess the way a user does, for the end-to-end tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEEL = [sys.executable, "-m", "torchkeel.cli.main"]


def keel_env(**extra: str) -> dict[str, str]:
    """PYTHONPATH with the examples and test helpers; one thread so runs are bitwise comparable."""
    path = os.pathsep.join([str(ROOT / "examples"), str(ROOT / "tests" / "e2e"), str(ROOT / "tests")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def run_keel(*args: str, cwd: Path, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*KEEL, *args], cwd=cwd, env=keel_env(**env), capture_output=True, text=True, timeout=timeout)


def start_keel(*args: str, cwd: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*KEEL, *args], cwd=cwd, env=keel_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
