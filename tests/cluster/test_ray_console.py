"""``keel train --ray`` on a Ray it starts itself, as a user runs it: the console holds keel's
lines, each once, and no line of Ray's again and again. A module of its own, so that no other
Ray cluster runs beside it (two on one machine make Ray Train's state queries fail)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray[train]')")

from distrun import env, write_config  # noqa: E402

import torchkeel  # noqa: E402


def plain(line: str) -> str:
    """A console line without Ray's colours, ``(Actor pid=N)`` prefix and dedup note."""
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    line = re.sub(r"^\(\S+(?: pid=\d+)?(?:, ip=\S+)?\) ", "", line)
    return re.sub(r"\s*\[repeated \d+x across cluster\].*$", "", line).strip()


def test_keel_train_ray_prints_each_of_its_lines_once_and_no_line_of_rays_again_and_again(tmp_path):
    """``keel train --ray`` starts its own Ray: each line keel prints in a worker reaches the console
    once (Ray Train's print patch logged it a second time), and Ray does not repeat itself (its
    placement-group cleaner warned every second that the state API, not in ray[train], did not answer)."""
    write_config(tmp_path)
    paths = env()
    paths["PYTHONPATH"] = os.pathsep.join([str(Path(torchkeel.__file__).parents[1]), paths["PYTHONPATH"]])
    done = subprocess.run(
        [sys.executable, "-m", "torchkeel.cli.main", "train", "cfg.yaml", "--ray", "2", "train.max_steps=12"],
        cwd=tmp_path,
        env=paths,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [plain(line) for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert any(line.startswith("keel: ") for line in lines), lines
    assert [line for line, n in Counter(lines).items() if n > 1] == [], lines
