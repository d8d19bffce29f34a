"""Where a run came from: versions, the git commit of the working directory, the config hash."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import torch

from torchkeel._version import __version__


def git_state(directory: str | Path = ".") -> dict[str, Any]:
    """``{"commit": sha, "dirty": bool}`` of the git work tree at ``directory``; ``None`` values outside one."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(directory), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        if commit.returncode != 0:
            return {"commit": None, "dirty": None}
        status = subprocess.run(
            ["git", "-C", str(directory), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}


def provenance(config_hash: str) -> dict[str, Any]:
    """Fields every checkpoint manifest carries."""
    git = git_state()
    return {
        "torch_version": torch.__version__,
        "torchkeel_version": __version__,
        "git_commit": git["commit"],
        "git_dirty": git["dirty"],
        "config_hash": config_hash,
    }
