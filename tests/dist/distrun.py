"""Running ``keel train`` under real ``torchrun --standalone`` (127.0.0.1, gloo) for the tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from torchkeel.checkpoint import CheckpointStore
from torchkeel.checkpoint.foreign import checkpoint_weights

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
CONFIG = """
name: run
out_dir: runs
seed: 3
device: cpu
model: {target: distmodels:mlp}
data: {target: hand_written_loop:make_data, num_workers: 0}
optim: {name: sgd, lr: 0.05}
train: {max_epochs: null, max_steps: 20, batch_size: 64, log_every: 5}
checkpoint: {every_s: 0}
dist: {init_timeout_s: 120, timeout_s: 60}
"""


def env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "examples"), str(HERE), str(ROOT / "tests")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def write_config(directory: Path) -> Path:
    path = directory / "cfg.yaml"
    path.write_text(CONFIG)
    return path


def keel_command(nproc: int, *args: str, max_restarts: int = 0) -> list[str]:
    """``keel train`` in one process, or under ``torchrun --standalone`` with ``nproc`` workers."""
    keel = ["-m", "torchkeel.cli.main", "train", "cfg.yaml", "--no-progress", *args]
    if nproc == 1:
        return [sys.executable, *keel]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.2", *keel]


def train(cwd: Path, nproc: int, *args: str, timeout: float = 240, max_restarts: int = 0,
          **extra: str) -> subprocess.CompletedProcess:
    result = subprocess.run(keel_command(nproc, *args, max_restarts=max_restarts), cwd=cwd, env=env(**extra),
                            capture_output=True, text=True, timeout=timeout)
    return result


def final(cwd: Path, name: str):
    """The newest valid checkpoint of run ``name`` and its full weights."""
    found, problems = CheckpointStore(cwd / "runs" / name / "checkpoints").latest_valid()
    assert found is not None, problems
    return found, checkpoint_weights(found)


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)
