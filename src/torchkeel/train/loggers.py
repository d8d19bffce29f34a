"""Where a run's rows go besides ``metrics.jsonl``: TensorBoard, or any logger with three methods.

A logger is anything with ``log_metrics(step, values)``, ``log_incident(row)`` and ``close()``
(and, if it wants the run's final status, ``finish(status)``, called instead of ``close()``).
TensorBoard, MLflow and W&B are built in (``logging.tensorboard: true``, ``logging.mlflow``, ``logging.wandb``); others plug in through
``logging.loggers: [module:callable]``, each called with ``(run_dir, config_dict)``. Only rank 0
logs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

from torchkeel.config.imports import build_target
from torchkeel.errors import ConfigError, MissingExtraError
from torchkeel.train.tracking import MlflowLogger, WandbLogger

_NOT_SCALARS = {"kind", "step", "epoch", "wall_s", "time"}
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
    on resume, the events from that step on (written after the checkpoint the run continues
    from) are dropped by TensorBoard's reader, as ``metrics.jsonl`` is truncated.
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
            self.flush()

    def log_incident(self, row: dict[str, Any]) -> None:
        self.pending.append((self._text("incidents", f"{row['kind']}: {row['message']}"), row["step"]))

    def flush(self) -> None:
        for summary, step in self.pending:
            self.writer.add_summary(summary, step)
        self.pending.clear()
        self.flushed_at = time.monotonic()

    def close(self) -> None:
        self.flush()
        self.writer.close()


class RunLoggers:
    """The run's loggers, fed the rows the Trainer writes to ``metrics.jsonl`` and ``incidents.jsonl``."""

    def __init__(self, loggers: list[Logger]) -> None:
        self.loggers = loggers

    @classmethod
    def from_config(
        cls, logging_config: Any, run_dir: Path, config: dict[str, Any], config_text: str, resume_step: int | None
    ) -> RunLoggers:
        loggers: list[Logger] = []
        if logging_config.tensorboard:
            loggers.append(TensorBoardLogger(run_dir / "tensorboard", config_text=config_text, purge_step=resume_step))
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
        return cls(loggers)

    def log(self, row: dict[str, Any]) -> None:
        """One ``metrics.jsonl`` row: its numbers, tagged ``<kind>/<key>``, at its step."""
        if not self.loggers or "step" not in row:
            return
        kind = row.get("kind", "train")
        values = {
            f"{kind}/{k}": float(v)
            for k, v in row.items()
            if k not in _NOT_SCALARS and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if values:
            for logger in self.loggers:
                logger.log_metrics(int(row["step"]), values)

    def log_incident(self, row: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.log_incident(row)

    def close(self, status: str | None = None) -> None:
        """Close every logger; one with ``finish(status)`` is told how the run ended instead."""
        for logger in self.loggers:
            finish = getattr(logger, "finish", None)
            if callable(finish):
                finish(status)
            else:
                logger.close()
