"""``keel`` called in the test's process: the function the console script calls, for the end-to-end
tests that need no process boundary (no signal, kill, torchrun or environment of their own).

A test takes the ``keel_main`` fixture (imported into its module) and calls it as it would
``keelproc.run_keel``: ``keel_main("train", str(cfg), cwd=tmp_path)`` returns the exit code,
stdout and stderr.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from torchkeel.cli.main import main


@dataclass
class Result:
    """What ``keel`` did: its exit code (argparse's ``SystemExit`` included) and its output."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def keel_main(monkeypatch, capsys):
    """``keel_main(*args, cwd=DIR, **env) -> Result``: ``keel`` run in DIR in this process, with one torch
    thread as ``keelproc``'s subprocesses have (OMP_NUM_THREADS=1); the working directory and
    ``sys.path`` (keel train puts its working directory on it) and the environment variables set
    from ``env`` are put back after the test."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(sys, "path", list(sys.path))

    def call(*args: str, cwd: Path, **env: str) -> Result:
        monkeypatch.chdir(cwd)
        for name, value in env.items():  # until the test ends
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as exited:  # argparse's usage errors
            code = exited.code
        out, err = capsys.readouterr()
        return Result(code, out, err)

    return call
