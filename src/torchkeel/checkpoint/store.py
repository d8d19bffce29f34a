"""A directory of checkpoints: save (sync or in the background), find the newest valid one, prune.

Pruning happens only after a new checkpoint is complete, and keeps the ``keep_last`` newest
plus the ``save_top_k`` best by the monitored metric, so there is always a previous valid
checkpoint to fall back to. Only the process that writes shared files (rank 0) should save.
"""

from __future__ import annotations

import re
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchkeel.checkpoint.format import (
    MANIFEST,
    Checkpoint,
    PointHook,
    read_checkpoint,
    read_manifest,
    snapshot,
    write_checkpoint,
)
from torchkeel.errors import CheckpointError

_NAME = re.compile(r"^step-(\d+)$")
_TRASH = ".removing-"  # a pruned checkpoint on its way out


def _remove_all(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


class CheckpointStore:
    """Checkpoints ``step-<step>`` under ``directory``.

    Example (a hand-written loop)::

        store = CheckpointStore("runs/x/checkpoints", keep_last=2)
        store.save(capture_training_state(model, optimizer), step=step, epoch=epoch)
        found, problems = store.latest_valid()
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        keep_last: int = 2,
        save_top_k: int = 1,
        monitor: str = "val_loss",
        mode: str = "min",
        hook: PointHook | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1: the newest checkpoint is always kept")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.save_top_k = save_top_k
        self.monitor = monitor
        self.mode = mode
        self.hook = hook

    def path_for(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}"

    def save(
        self,
        state: Mapping[str, Any],
        *,
        step: int,
        epoch: int,
        metrics: Mapping[str, float] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write a checkpoint of ``state`` now, then prune; return its directory.

        The tensors are streamed from where they are (no copy of the state is made), so the
        caller waits for the write and must not change them meanwhile; ``AsyncSaver`` does not
        wait: it calls this from its thread with a ``snapshot`` only it holds.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        manifest = {"step": step, "epoch": epoch, "metrics": dict(metrics or {}), **(meta or {})}
        path = write_checkpoint(self.path_for(step), state, manifest, self.hook)
        self.prune()
        return path

    def steps(self) -> list[tuple[int, Path]]:
        """Every ``step-*`` directory, complete or not, newest first."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
        return sorted(found, reverse=True)

    def latest_valid(self) -> tuple[Checkpoint | None, list[str]]:
        """The newest checkpoint that passes every check, and one line per newer one that did not."""
        problems = []
        for _, path in self.steps():
            try:
                return read_checkpoint(path), problems
            except CheckpointError as exc:
                problems.append(str(exc))
        return None, problems

    def prune(self) -> None:
        """Remove incomplete checkpoints and complete ones that are neither recent nor best.

        A removed checkpoint is renamed out of the ``step-*`` namespace at once and deleted on a
        background thread: unlinking gigabytes takes long, and the training loop need not wait.
        """
        complete: list[tuple[int, Path, dict[str, Any]]] = []
        for step, path in self.steps():
            try:
                complete.append((step, path, read_manifest(path)))
            except CheckpointError:
                self._discard(path)  # a write that was killed: never valid
        keep = {path for _, path, _ in complete[: self.keep_last]}
        scored = [
            (m["metrics"][self.monitor], step, path)
            for step, path, m in complete
            if isinstance(m.get("metrics", {}).get(self.monitor), (int, float))
        ]
        scored.sort(key=lambda item: item[0], reverse=self.mode == "max")
        keep.update(path for _, _, path in scored[: self.save_top_k])
        for _, path, _ in complete:
            if path not in keep:
                self._discard(path)
        for temp in self.directory.glob(".step-*.tmp"):  # a write that was killed; none is in flight now
            temp.unlink(missing_ok=True)
        leftovers = [p for p in self.directory.glob(f"{_TRASH}*") if p.is_dir()]  # just renamed, or left by a kill
        if leftovers:
            # Not a daemon: a daemon thread still in rmtree when the interpreter shuts down is cut off
            # inside a tensor's deallocation (its garbage collection can reach one) and aborts the
            # process (exit 134) after a run that succeeded. The exit waits for the removal instead.
            threading.Thread(target=_remove_all, args=(leftovers,), name="torchkeel-prune").start()

    def _discard(self, path: Path) -> None:
        trash = path.with_name(f"{_TRASH}{path.name}")
        try:
            path.rename(trash)
        except OSError:
            shutil.rmtree(path, ignore_errors=True)


class AsyncSaver:
    """Saves through a ``CheckpointStore`` on a background thread, one save in flight at a time.

    ``save`` blocks only to copy the state to CPU memory (and for a previous save still being
    written). The copy's memory is kept and reused by the next save, so that copying is a
    memcpy, not an allocation. An error in the background is raised by the next ``save`` or ``wait``.
    """

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staging: Any = None  # the last snapshot, written: its memory serves the next one

    def save(self, state: Mapping[str, Any], **kwargs: Any) -> None:
        self.wait()
        copy = self._staging = snapshot(state, self._staging)
        self._thread = threading.Thread(target=self._run, args=(copy, kwargs), name="torchkeel-checkpoint")
        self._thread.start()

    def wait(self) -> None:
        """Block until the save in flight is on disk; re-raise its error if it failed."""
        self.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def join(self) -> None:
        """Block until the save in flight is done, keeping any error for the next ``wait``."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self, state: Mapping[str, Any], kwargs: dict[str, Any]) -> None:
        try:
            self.store.save(state, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._error = exc


def is_checkpoint_dir(path: str | Path) -> bool:
    """Whether ``path`` looks like a torchkeel checkpoint directory (has a manifest)."""
    return (Path(path) / MANIFEST).is_file()
