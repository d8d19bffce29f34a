"""The run directory ``<out_dir>/<name>``: created once, never silently overwritten.

``--overwrite`` does not delete the previous run up front: it is moved aside (same filesystem,
``<out_dir>/.<name>.previous``) and removed only once the new run has written its first
checkpoint (or completed); a new run that fails before that gets the previous one put back.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from torchkeel.errors import RunDirError

# Files whose presence marks a directory as a torchkeel run (and so safe to --overwrite).
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "summary.json")


@dataclass
class PreviousRun:
    """A run that ``--overwrite`` set aside: discarded once the new run is safe, or put back."""

    run_dir: Path
    aside: Path

    def discard(self) -> None:
        shutil.rmtree(self.aside, ignore_errors=True)

    def restore(self) -> None:
        """Replace whatever the new run left in ``run_dir`` with the previous run."""
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.aside.rename(self.run_dir)


def prepare_run_dir(out_dir: str | Path, name: str, *, overwrite: bool = False,
                    resume: bool = False) -> tuple[Path, PreviousRun | None]:
    """Create ``out_dir/name``; return it and, after ``overwrite`` replaced a run, that run set aside.

    With ``resume`` an existing run directory is reused.

    Raises:
        RunDirError: the directory exists and is not empty (without ``overwrite``), or
            ``overwrite`` was asked for a directory that is not a torchkeel run.
    """
    run_dir = Path(out_dir) / name
    previous = None
    if run_dir.exists() and any(run_dir.iterdir()):
        if resume and not overwrite:
            for leftover in run_dir.glob(".*.tmp"):  # from a write that a kill interrupted
                leftover.unlink()
            return run_dir, None
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
        previous = PreviousRun(run_dir, run_dir.with_name(f".{name}.previous"))
        if previous.aside.exists():  # set aside by an attempt that was killed before it was safe
            if _has_checkpoint(run_dir):
                shutil.rmtree(previous.aside)  # that attempt got far enough: the older run is obsolete
            else:
                shutil.rmtree(run_dir)  # it did not: the run set aside is still the last good one
        if run_dir.exists():
            run_dir.rename(previous.aside)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, previous


def _has_checkpoint(run_dir: Path) -> bool:
    return any(run_dir.glob("checkpoints/step-*/manifest.json"))
