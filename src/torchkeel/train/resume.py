"""Choosing the checkpoint to resume from, and trimming run files back to it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from torchkeel.checkpoint import Checkpoint, CheckpointStore, read_checkpoint
from torchkeel.io import write_text_atomic


def find_checkpoint(store: CheckpointStore, resume: str | Path, warn: Callable[[str], None]) -> Checkpoint | None:
    """``"auto"``: the newest valid checkpoint in ``store`` (``None``: start fresh), each
    skipped one reported through ``warn``; otherwise the checkpoint directory ``resume``.

    Raises:
        CheckpointError: an explicit ``resume`` path that is missing or fails verification.
    """
    if str(resume) != "auto":
        return read_checkpoint(resume)
    found, problems = store.latest_valid()
    for problem in problems:
        warn(f"skipping invalid checkpoint: {problem}")
    if found is None and problems:
        warn("no valid checkpoint left; starting from scratch")
    return found


def truncate_metrics(path: Path, step: int) -> None:
    """Drop ``metrics.jsonl`` rows written after ``step`` (by a run that was killed later).

    The resumed run writes them again, so the file reads as one uninterrupted run.
    """
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the kill
        if row.get("step", 0) <= step:
            kept.append(line + "\n")
    write_text_atomic(path, "".join(kept))
