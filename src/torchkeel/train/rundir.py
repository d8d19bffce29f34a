"""The run directory ``<out_dir>/<name>``: created once, never silently overwritten.

``--overwrite`` does not delete the previous run up front: it is moved aside (same filesystem,
``<out_dir>/.<name>.previous``) and removed only once the new run has written its first
checkpoint (or completed); a new run that fails before that gets the previous one put back.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from torchkeel.errors import RunDirError, TrainingDiverged
from torchkeel.io import write_json_atomic, write_text_atomic
from torchkeel.train.incidents import IncidentLog
from torchkeel.train.loggers import RunLoggers
from torchkeel.train.protect import Observed
from torchkeel.train.runlog import MetricsWriter, Progress, drop_rows_after, read_metrics

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


def prepare_run_dir(
    out_dir: str | Path, name: str, *, overwrite: bool = False, resume: bool = False
) -> tuple[Path, PreviousRun | None]:
    """Create ``out_dir/name``; return it and, after ``overwrite`` replaced a run, that run set aside.

    With ``resume`` an existing run directory is reused.

    Raises:
        RunDirError: the directory exists and is not empty (without ``overwrite``), or
            ``overwrite`` was asked for a directory that is not a torchkeel run. A run that
            failed before its first step (``summary.json`` says failed; no checkpoint, no row
            past step 0) is taken over.
    """
    run_dir = check_run_dir(out_dir, name, resume=resume, overwrite=overwrite)
    previous = None
    if run_dir.exists() and any(run_dir.iterdir()):
        if resume and not overwrite:
            for leftover in run_dir.glob(".*.tmp"):  # from a write that a kill interrupted
                leftover.unlink()
            return run_dir, None
        if overwrite:
            previous = _set_aside(run_dir)
        else:
            shutil.rmtree(run_dir)  # a run that failed before its first step: nothing in it to keep
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, previous


def check_run_dir(out_dir: str | Path, name: str, *, resume: bool = False, overwrite: bool = False) -> Path:
    """The run directory, checked without touching it: what ``prepare_run_dir`` would refuse, said
    before any rank (or a launcher) starts.

    Raises:
        RunDirError: it exists and holds a trained run, without ``resume`` or ``overwrite``.
    """
    run_dir = Path(out_dir) / name
    if not (resume or overwrite) and run_dir.exists() and any(run_dir.iterdir()) and not _never_trained(run_dir):
        raise RunDirError(
            f"run directory '{run_dir}' already exists; continue it with --resume auto, choose "
            f"another name (name=...) or pass --overwrite to replace it"
        )
    return run_dir


def earlier_wall_s(run_dir: Path) -> float:
    """Seconds the earlier processes of a run took, for its resumed process to count on from: the
    latest ``wall_s`` they recorded, in ``summary.json`` (a process that ended) or in a row of
    ``metrics.jsonl`` (one that was killed: its time after its last row written is lost). Read
    before the rows after the checkpoint are dropped, so that a killed process's work after its
    checkpoint, which the resumed one does again, still counts."""
    metrics, summary = run_dir / "metrics.jsonl", run_dir / "summary.json"
    recorded = [row.get("wall_s") for row in read_metrics(metrics)] if metrics.exists() else []
    try:
        recorded.append(json.loads(summary.read_text()).get("wall_s"))
    except (OSError, ValueError, AttributeError):  # none, or not a summary
        pass
    return max((float(s) for s in recorded if isinstance(s, (int, float)) and not isinstance(s, bool)), default=0.0)


def _set_aside(run_dir: Path) -> PreviousRun:
    """Move the run ``--overwrite`` replaces to ``.<name>.previous`` (refusing what is not a run)."""
    if not any((run_dir / marker).exists() for marker in RUN_MARKERS):
        raise RunDirError(
            f"refusing to overwrite '{run_dir}': it is not a torchkeel run directory "
            f"(none of {', '.join(RUN_MARKERS)}); choose another name or out_dir"
        )
    previous = PreviousRun(run_dir, run_dir.with_name(f".{run_dir.name}.previous"))
    if previous.aside.exists():  # set aside by an attempt that was killed before it was safe
        if _has_checkpoint(run_dir):
            shutil.rmtree(previous.aside)  # that attempt got far enough: the older run is obsolete
        else:
            shutil.rmtree(run_dir)  # it did not: the run set aside is still the last good one
    if run_dir.exists():
        run_dir.rename(previous.aside)
    return previous


def _has_checkpoint(run_dir: Path) -> bool:
    return any(run_dir.glob("checkpoints/step-*/manifest.json"))


def _never_trained(run_dir: Path) -> bool:
    """A torchkeel run that failed before its first step: ``summary.json`` says failed, there is
    no checkpoint and no row past step 0, and nothing else a person put there. (A run without
    ``summary.json`` may still be going: it is never taken over.)"""
    ours = {*RUN_MARKERS, "incidents.jsonl", "mlflow_run_id", "wandb_run_id", "tensorboard", "wandb", "checkpoints"}
    if {p.name for p in run_dir.iterdir()} - ours or _has_checkpoint(run_dir):
        return False
    try:
        failed = json.loads((run_dir / "summary.json").read_text()).get("status") == "failed"
    except (OSError, ValueError, AttributeError):
        return False
    metrics = run_dir / "metrics.jsonl"
    return failed and (not metrics.exists() or all(row.get("step", 0) == 0 for row in read_metrics(metrics)))


class RunFiles:
    """The files of one run in ``<out_dir>/<name>`` — ``config.yaml``, ``metrics.jsonl``,
    ``incidents.jsonl``, the loggers, ``summary.json`` — and the console lines that go with them.

    Rank 0 writes; on the other ranks every write is a no-op, but incidents are still counted
    (every rank decides the same from the counts). ``open()`` prepares the directory; until the
    new run is safe (its first checkpoint, or its end) a run ``--overwrite`` set aside can be put
    back (``settle``).
    """

    def __init__(self, run_dir: Path, *, is_main: bool, console: Progress | None = None) -> None:
        self.run_dir, self.is_main = run_dir, is_main
        self.console = console if console is not None else Progress(0, enabled=False)
        self.incidents = IncidentLog(None)
        self._metrics: MetricsWriter | None = None
        self._loggers = RunLoggers([])
        self._previous: PreviousRun | None = None
        self._start = time.perf_counter()
        self._earlier_s = 0.0  # the earlier processes' seconds, of a resumed run (rank 0)
        self.summary: dict[str, Any] = {}
        self.row_hooks: list[Callable[[dict[str, Any]], None]] = []

    def open(
        self, config: dict[str, Any], *, resume: bool, resume_step: int | None, overwrite: bool, logging: Any
    ) -> None:
        """Create (or reuse, on a resume) the directory; drop rows a killed run wrote after ``resume_step``."""
        self._start = time.perf_counter()
        if not self.is_main:
            return
        text = yaml.safe_dump(config, sort_keys=False)
        _, self._previous = prepare_run_dir(self.run_dir.parent, self.run_dir.name, overwrite=overwrite, resume=resume)
        if resume_step is not None:
            self._earlier_s = earlier_wall_s(self.run_dir)  # before the rows after the checkpoint go
        write_text_atomic(self.run_dir / "config.yaml", text)
        for name in ("metrics.jsonl", "incidents.jsonl"):  # a fresh start (no checkpoint) keeps none
            drop_rows_after(self.run_dir / name, -1 if resume_step is None else resume_step)
        self._metrics = MetricsWriter(self.run_dir / "metrics.jsonl")
        try:
            self._loggers = RunLoggers.from_config(logging, self.run_dir, config, text, resume_step)
        except Exception as exc:  # a tracker that cannot start: the run failed before its first step
            write_json_atomic(
                self.run_dir / "summary.json", {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
            )
            raise
        if resume_step is not None:
            self._loggers.catch_up(read_metrics(self.run_dir / "metrics.jsonl"), resume_step)
        self.incidents.path = self.run_dir / "incidents.jsonl"

    @property
    def wall_s(self) -> float:
        """Seconds the run has taken so far: this process's, and on rank 0 of a resumed run its
        earlier processes' (``earlier_wall_s``)."""
        return self._earlier_s + self.process_wall_s

    @property
    def process_wall_s(self) -> float:
        """Seconds since this process opened the run."""
        return time.perf_counter() - self._start

    def log(self, row: dict[str, Any]) -> None:
        """A ``metrics.jsonl`` row (stamped with the run's ``wall_s``), to every logger and the console (rank
        0), and to ``row_hooks`` on every rank: the Trainer logs the same rows at the same steps on
        every rank, which an engine that needs every rank to report (Ray Train) relies on."""
        row["wall_s"] = round(self.wall_s, 4)
        if self._metrics is not None:
            self._metrics.write(row)
        self._loggers.log(row)
        self.console.log(row)
        for hook in self.row_hooks:
            hook(row)

    def flush(self) -> None:
        """``metrics.jsonl``'s rows on disk and every row so far with the loggers, now; before a
        save, so that a resume finds every row up to its checkpoint."""
        if self._metrics is not None:
            self._metrics.flush()
        self._loggers.flush()

    def say(self, message: str) -> None:
        """A line a person must see (rank 0), progress output or not."""
        if self.is_main:
            self.console.say(message)

    def note(self, message: str) -> None:
        """A line of information (rank 0, progress output on)."""
        if self.is_main:
            self.console.note(message)

    def incident(self, kind: str, step: int, message: str, *, quiet: bool = False, **details: Any) -> None:
        """Count and record an incident; print it unless ``quiet`` (in the files, not printed again)."""
        row = self.incidents.record(kind, step, message, **details)
        if self.is_main:
            if not quiet:
                self.console.warn(f"step {row['step']}: {message}")
            self._loggers.log_incident(row)

    def data_ready(self, tuning: Any, empty_files: list[str]) -> None:
        """What the data said at start: how ``num_workers: auto`` chose (a row and a line), and an
        incident for each empty file (a fresh run's; a resumed one has them from its checkpoint)."""
        if tuning is not None:
            self.log({"step": 0, **tuning.row()})
            self.say(f"data.num_workers=auto: {tuning.num_workers} ({tuning.reason})")  # --no-progress too
        for path in empty_files:
            self.incident("empty_file", 0, f"{path} is empty: it holds no sample, and was left out")

    def compile_event(self, step: int, kind: str, message: str, details: dict[str, Any]) -> None:
        """What ``torch.compile`` reported: its compile time is a metrics row, a graph break or a
        fall-back to eager an incident."""
        if "compile_s" in details:
            self.log({"kind": "compile", "step": step, **details})
            self.note(message)
        else:
            self.incident(kind, step, message, **details)

    def totals(self) -> dict[str, Any]:
        """The summary's share: incidents by kind, the run's seconds (``wall_s``: every process of
        it; ``process_wall_s``: this one, since ``open()``), the run directory."""
        return {
            "incidents": dict(self.incidents.counts),
            "wall_s": round(self.wall_s, 3),
            "process_wall_s": round(self.process_wall_s, 3),
            "run_dir": str(self.run_dir),
        }

    def record(self, step: int, found: Observed) -> None:
        """Log and record what the protections found at ``step``; then raise the error they give, if any."""
        for row in found.rows:
            self.log(row)
        for incident in found.incidents:
            self.incident(incident.kind, step, incident.message, quiet=incident.quiet, **incident.details)
        if found.error is not None:
            raise found.error

    def first_checkpoint_written(self) -> None:
        """The new run is safe: the run ``--overwrite`` set aside goes."""
        if self._previous is not None:
            self._previous.discard()
            self._previous = None

    @property
    def holds_previous(self) -> bool:
        return self._previous is not None

    def settle(self, status: str) -> bool:
        """Discard the run set aside when the new one ended well, else put it back (and return True)."""
        previous, self._previous = self._previous, None
        if previous is None:
            return False
        if status in ("completed", "preempted", "stopped_early"):
            previous.discard()
            return False
        previous.restore()
        return True

    @contextmanager
    def ending(
        self, totals: Callable[[], dict[str, Any]], distinct: Callable[[], dict[str, int]]
    ) -> Iterator[dict[str, Any]]:
        """Around a run: yields its summary for the block to set ``status`` in; however the block
        ends, ``summary.json`` gets the status (``failed`` with ``error``, ``interrupted``) and
        ``totals()``, and the run ``--overwrite`` set aside is discarded or put back."""
        summary: dict[str, Any] = {"status": "failed"}
        error: BaseException | None = None
        try:
            yield summary
        except KeyboardInterrupt as exc:
            summary, error = {"status": "interrupted"}, exc
            raise
        except Exception as exc:
            error = exc
            summary = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
            if isinstance(exc, TrainingDiverged):
                summary["diagnosis"] = exc.diagnosis
            raise
        finally:
            self.summary = self.close({**summary, **totals()}, distinct())
            if self.settle(self.summary["status"]) and error is not None:
                error.__notes__ = [
                    *getattr(error, "__notes__", []),
                    f"the previous run was put back in '{self.run_dir}'",
                ]

    def close(self, summary: dict[str, Any], distinct: dict[str, int] | None = None) -> dict[str, Any]:
        """Print the incidents' line, close the loggers and write ``summary.json``; returns ``summary``."""
        self.console.close()
        line = self.incidents.summary_line(distinct)
        if line and self.is_main:
            print(f"keel: {line} (details: {self.run_dir / 'incidents.jsonl'})", file=sys.stderr)
        self._loggers.close(summary.get("status"))
        if self._metrics is not None:
            self._metrics.close()
            write_json_atomic(self.run_dir / "summary.json", summary)
        return summary
