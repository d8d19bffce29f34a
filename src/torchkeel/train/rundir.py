"""The run directory ``<out_dir>/<name>``: created once, never silently overwritten."""

from __future__ import annotations

import shutil
from pathlib import Path

from torchkeel.errors import RunDirError

# Files whose presence marks a directory as a torchkeel run (and so safe to --overwrite).
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "summary.json")


def prepare_run_dir(out_dir: str | Path, name: str, *, overwrite: bool = False, resume: bool = False) -> Path:
    """Create ``out_dir/name`` and return it. With ``resume`` an existing run directory is reused.

    Raises:
        RunDirError: the directory exists and is not empty (without ``overwrite``), or
            ``overwrite`` was asked for a directory that is not a torchkeel run.
    """
    run_dir = Path(out_dir) / name
    if run_dir.exists() and any(run_dir.iterdir()):
        if resume and not overwrite:
            for leftover in run_dir.glob(".*.tmp"):  # from a write that a kill interrupted
                leftover.unlink()
            return run_dir
        if not overwrite:
            raise RunDirError(
                f"run directory '{run_dir}' already exists; continue it with --resume auto, choose "
                f"another name (name=...) or pass --overwrite to replace it"
            )
        if not any((run_dir / marker).exists() for marker in RUN_MARKERS):
            raise RunDirError(
                f"refusing to overwrite '{run_dir}': it is not a torchkeel run directory "
                f"(none of {', '.join(RUN_MARKERS)}); choose another name or out_dir"
            )
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir
