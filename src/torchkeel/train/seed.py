"""Seeding for reproducible runs: one call seeds everything a training run draws from."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device); optionally force determinism.

    ``deterministic=True`` turns on ``torch.use_deterministic_algorithms`` and deterministic
    cuDNN (no autotuning), and sets ``CUBLAS_WORKSPACE_CONFIG``, which cuBLAS reads to make its
    reductions deterministic. Data order and DataLoader workers are seeded by
    ``torchkeel.data.EpochLoader`` from the same seed (see ``torchkeel.data.seed_worker``).
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False

