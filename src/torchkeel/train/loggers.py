"""Where a run's rows go besides ``metrics.jsonl``: TensorBoard, or any logger with three methods.

A logger is anything with ``log_metrics(step, values)``, ``log_incident(row)`` and ``close()``
(and, if it wants the run's final status, ``finish(status)``, called instead of ``close()``).
TensorBoard, MLflow and W&B are built in (``logging.tensorboard: true``, ``logging.mlflow``,
``logging.wandb``); others plug in through ``logging.loggers: [module:callable]``, each called
with ``(run_dir, config_dict)``. Only rank 0 logs.

Every row of ``metrics.jsonl`` reaches every logger once, however the run ends:

- a logger with ``flush()`` is flushed before every checkpoint save (TensorBoard: its events on
  disk; a resumed run's TensorBoard reader drops the events after the checkpoint's step);
- a *tracker*, a logger with ``last_step()`` (MLflow, W&B: a store that cannot take a row back),
  is handed rows only when a checkpoint is saved and when the run ends (every 30 s when the run
  saves no checkpoints), so it never holds a row that a resumed run computes again. On resume it
  is sent the rows of ``metrics.jsonl`` after its ``last_step()`` (those a kill took with it),
  and a row the resumed run computes again at a step it already holds (a kill during a save) is
  not sent twice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torchkeel.config.imports import build_target
from torchkeel.errors import ConfigError, MissingExtraError
from torchkeel.train.tracking import MlflowLogger, WandbLogger

_NOT_SCALARS = {"kind", "step", "time"}  # the rest of a row's numbers, epoch and wall_s included, go out
FLUSH_ROWS, FLUSH_S = 100, 30.0


class Logger(Protocol):
    def log_metrics(self, step: int, values: dict[str, float]) -> None: ...
    def log_incident(self, row: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class TensorBoardLogger:
    """Event files under ``log_dir``: every scalar as ``<kind>/<key>`` (``train/loss``,
    ``val/val_f1``, ``memory/rss_bytes``) at its step, incidents and the config as text.

    A row's scalars go out as one event (one summary with several values) rather than one event
    each: building the protocol buffers is what costs, on the training thread. ``purge_step``:
    on resume, the first step the run trains again; the events written before from that step on
    (after the checkpoint the run continues from) are dropped by TensorBoard's reader, as
    ``metrics.jsonl`` is truncated.
    """

    def __init__(self, log_dir: str | Path, *, config_text: str | None = None, purge_step: int | None = None) -> None:
        try:
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog
            from tensorboard.compat.proto.summary_pb2 import Summary
            from torch.utils.tensorboard.summary import text
            from torch.utils.tensorboard.writer import FileWriter
        except ImportError:
            raise MissingExtraError("tensorboard", "tensorboard", "logging.tensorboard") from None
        self._summary, self._text = Summary, text
        self.writer = FileWriter(str(log_dir))
        self.pending: list[tuple[Any, int]] = []
        self.flushed_at = time.monotonic()
        if purge_step:
            self.writer.add_event(Event(step=purge_step, file_version="brain.Event:2"))
            self.writer.add_event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        elif config_text is not None:
            self.writer.add_summary(text("config", f"```\n{config_text}\n```"), 0)

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        summary = self._summary(
            value=[self._summary.Value(tag=tag, simple_value=value) for tag, value in values.items()]
        )
        self.pending.append((summary, step))
        # Handed to the writer thread in bursts (its checksums are pure Python and hold the GIL):
        # at a validation row, every FLUSH_ROWS rows, every FLUSH_S seconds, and at close.
        if (
            any(tag.startswith("val/") for tag in values)
            or len(self.pending) >= FLUSH_ROWS
            or time.monotonic() - self.flushed_at >= FLUSH_S
        ):
            self._hand_over()

    def log_incident(self, row: dict[str, Any]) -> None:
        self.pending.append((self._text("incidents", f"{row['kind']}: {row['message']}"), row["step"]))

    def _hand_over(self) -> None:
        for summary, step in self.pending:
            self.writer.add_summary(summary, step)
        self.pending.clear()
        self.flushed_at = time.monotonic()

    def flush(self) -> None:
        """Every event so far in the event file on disk (before a checkpoint save)."""
        self._hand_over()
        self.writer.flush()

    def close(self) -> None:
        self._hand_over()
        self.writer.close()


@dataclass
class HeldTracker:
    """A tracker's rows waiting for the next checkpoint, and the steps it holds already: a row the
    resumed run computes again at a step in ``(resumed_at, holds_to]`` is not sent again."""

    logger: Any
    waiting: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)
    resumed_at: int = 0
    holds_to: int = 0

    def add(self, kind: str, step: int, values: dict[str, Any]) -> None:
        if not self.resumed_at < step <= self.holds_to:
            self.waiting.append((kind, step, values))

    def send(self) -> None:
        for kind, step, values in self.waiting:
            if kind == "metrics":
                self.logger.log_metrics(step, values)
            else:
                self.logger.log_incident(values)
        self.waiting.clear()
        if callable(getattr(self.logger, "flush", None)):
            self.logger.flush()


class RunLoggers:
    """The run's loggers, fed the rows the Trainer writes to ``metrics.jsonl`` and ``incidents.jsonl``.

    ``hold``: trackers get rows at ``flush()`` (before each checkpoint) and at ``close()``;
    ``False`` (no checkpoints, so no resume): also every ``FLUSH_S`` seconds.
    """

    def __init__(self, loggers: list[Logger], *, hold: bool = True) -> None:
        self.loggers = loggers
        self.live = [logger for logger in loggers if not callable(getattr(logger, "last_step", None))]
        self.trackers = [HeldTracker(logger) for logger in loggers if logger not in self.live]
        self.hold, self.sent_at = hold, time.monotonic()

    @classmethod
    def from_config(
        cls, logging_config: Any, run_dir: Path, config: dict[str, Any], config_text: str, resume_step: int | None
    ) -> RunLoggers:
        loggers: list[Logger] = []
        if logging_config.tensorboard:
            loggers.append(
                TensorBoardLogger(
                    run_dir / "tensorboard",
                    config_text=config_text,
                    purge_step=None if resume_step is None else resume_step + 1,
                )
            )
        if logging_config.mlflow is not None:
            ml = logging_config.mlflow
            loggers.append(
                MlflowLogger(
                    run_dir,
                    config,
                    tracking_uri=ml.tracking_uri,
                    experiment=ml.experiment,
                    resume=resume_step is not None,
                )
            )
        if logging_config.wandb is not None:
            wb = logging_config.wandb
            loggers.append(
                WandbLogger(run_dir, config, project=wb.project, mode=wb.mode, resume=resume_step is not None)
            )
        for i, spec in enumerate(logging_config.loggers):
            logger = build_target(spec, {}, f"logging.loggers[{i}]", call_args=(run_dir, config))
            missing = [m for m in ("log_metrics", "log_incident", "close") if not callable(getattr(logger, m, None))]
            if missing:
                raise ConfigError(
                    f"logging.loggers[{i}]={spec!r} returned a {type(logger).__name__} without "
                    f"{', '.join(missing)}; a logger needs log_metrics(step, values), "
                    "log_incident(row) and close()"
                )
            loggers.append(logger)
        return cls(loggers, hold=bool(config.get("checkpoint", {}).get("enabled", True)))

    def catch_up(self, rows: list[dict[str, Any]], resume_step: int) -> None:
        """On resume from ``resume_step``: send each tracker the rows of ``rows`` (``metrics.jsonl``
        up to the checkpoint) after the last step it holds, and remember what it holds beyond."""
        for tracker in self.trackers:
            holds_to = tracker.logger.last_step()
            holds_to = -1 if holds_to is None else int(holds_to)
            for row in rows:
                values = scalars(row) if "step" in row else {}
                if values and int(row["step"]) > holds_to:
                    tracker.add("metrics", int(row["step"]), values)
            tracker.send()
            tracker.resumed_at, tracker.holds_to = resume_step, holds_to

    def log(self, row: dict[str, Any]) -> None:
        """One ``metrics.jsonl`` row: its numbers, tagged ``<kind>/<key>``, at its step."""
        if not self.loggers or "step" not in row:
            return
        values = scalars(row)
        if values:
            step = int(row["step"])
            for logger in self.live:
                logger.log_metrics(step, values)
            for tracker in self.trackers:
                tracker.add("metrics", step, values)
            self._send_if_due()

    def log_incident(self, row: dict[str, Any]) -> None:
        for logger in self.live:
            logger.log_incident(row)
        for tracker in self.trackers:
            tracker.add("incident", int(row.get("step", 0)), row)

    def flush(self) -> None:
        """Before a checkpoint save: every row so far to the trackers, and each logger's ``flush()``."""
        for tracker in self.trackers:
            tracker.send()
        for logger in self.live:
            if callable(getattr(logger, "flush", None)):
                logger.flush()
        self.sent_at = time.monotonic()

    def _send_if_due(self) -> None:
        if self.trackers and not self.hold and time.monotonic() - self.sent_at >= FLUSH_S:
            self.flush()

    def close(self, status: str | None = None) -> None:
        """Send what the trackers wait for, then close every logger; one with ``finish(status)`` is
        told how the run ended instead."""
        for tracker in self.trackers:
            tracker.send()
        for logger in self.loggers:
            finish = getattr(logger, "finish", None)
            if callable(finish):
                finish(status)
            else:
                logger.close()


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """A ``metrics.jsonl`` row's numbers as ``<kind>/<key>`` (what every logger gets)."""
    kind = row.get("kind", "train")
    return {
        f"{kind}/{k}": float(v)
        for k, v in row.items()
        if k not in _NOT_SCALARS and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
