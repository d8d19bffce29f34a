"""Experiment trackers as built-in loggers: ``logging.mlflow`` and ``logging.wandb``.

The same rows as ``metrics.jsonl`` and ``incidents.jsonl`` go to the tracker on rank 0: every
scalar as ``<kind>/<key>`` at its step, the resolved config as the run's params, each incident as
a tag. The tracker's run ends with the torchkeel run's status (finished, killed or preempted when
preempted or interrupted, failed), and a resumed run continues the same tracker run.

A tracker cannot take a row back, so each one answers ``last_step()`` (the highest step its store
holds): ``RunLoggers`` hands it rows only up to the checkpoint being saved, and on resume sends
it the rows it lacks up to the checkpoint's step (``torchkeel.train.loggers``).
"""

from __future__ import annotations

import json
import secrets
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torchkeel.errors import MissingExtraError

MAX_PARAM = 500
"""Characters of a param's value kept (older MLflow servers refuse longer values)."""
MAX_TAG = 5000
PARAMS_PER_CALL, METRICS_PER_CALL = 100, 1000  # MLflow's limits per log_batch
END_STATES = {"completed": "FINISHED", "stopped_early": "FINISHED", "preempted": "KILLED", "interrupted": "KILLED"}
"""torchkeel's final status → MLflow's run status (any other: ``FAILED``)."""


class MlflowLogger:
    """A torchkeel run as an MLflow run, through ``MlflowClient`` (no global state of mlflow's).

    ``tracking_uri``: where runs go (``None``: MLflow's default, ``MLFLOW_TRACKING_URI``);
    ``experiment``: its name (``None``: the run's ``name``). The run's id is kept in
    ``<run_dir>/mlflow_run_id`` so that a resumed run continues it.
    """

    def __init__(
        self,
        run_dir: Path,
        config: dict[str, Any],
        *,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        resume: bool = False,
    ) -> None:
        try:
            from mlflow import MlflowClient
            from mlflow.entities import Metric, Param
        except ImportError:
            raise MissingExtraError("mlflow", "mlflow-skinny", "logging.mlflow") from None
        self._metric = Metric
        self._pending: list[Any] = []
        self.client = MlflowClient(tracking_uri=tracking_uri)
        name = experiment or str(config.get("name") or "torchkeel")
        found = self.client.get_experiment_by_name(name)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(name)
        id_file, saved = saved_run_id(run_dir, "mlflow_run_id", resume)
        self.incidents = 0
        if saved is not None:
            self.run_id = saved
            self.client.update_run(self.run_id, status="RUNNING")
            self.incidents = int(self.client.get_run(self.run_id).data.tags.get("torchkeel.incidents", "0"))
            return
        run = self.client.create_run(
            experiment_id, run_name=Path(run_dir).name, tags={"torchkeel.run_dir": str(run_dir)}
        )
        self.run_id = run.info.run_id
        id_file.write_text(self.run_id)
        params = [Param(key[:250], str(value)[:MAX_PARAM]) for key, value in flatten(config).items()]
        for start in range(0, len(params), PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[start : start + PARAMS_PER_CALL])

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        """Held and sent in batches of ``METRICS_PER_CALL`` values and at ``flush()``, not one
        request per logged step."""
        at = int(time.time() * 1000)
        self._pending += [self._metric(k, v, at, step) for k, v in values.items()]
        if len(self._pending) >= METRICS_PER_CALL:
            self.flush()

    def flush(self) -> None:
        """Send the metrics held; when this returns they are in MLflow's store."""
        while self._pending:
            batch, self._pending = self._pending[:METRICS_PER_CALL], self._pending[METRICS_PER_CALL:]
            self.client.log_batch(self.run_id, metrics=batch)

    def last_step(self) -> int | None:
        """The highest step of any metric this MLflow run holds (``None``: none yet)."""
        keys = self.client.get_run(self.run_id).data.metrics
        return max((m.step for key in keys for m in self.client.get_metric_history(self.run_id, key)), default=None)

    def log_incident(self, row: dict[str, Any]) -> None:
        self.incidents += 1
        text = f"step {row.get('step')} {row.get('kind')}: {row.get('message', '')}"
        self.client.set_tag(self.run_id, f"torchkeel.incident.{self.incidents:04d}", text[:MAX_TAG])
        self.client.set_tag(self.run_id, "torchkeel.incidents", str(self.incidents))

    def finish(self, status: str | None) -> None:
        """Send what is held, then end the MLflow run with the torchkeel run's final ``status``."""
        self.flush()
        self.client.set_terminated(self.run_id, END_STATES.get(status or "completed", "FAILED"))

    def close(self) -> None:
        self.finish(None)


PREEMPTED = {"preempted", "interrupted"}
EXIT_CODES = {"completed": 0, "stopped_early": 0, "preempted": 143, "interrupted": 130}
"""torchkeel's final status → the exit code W&B records (any other: 1, failed)."""


class WandbLogger:
    """A torchkeel run as a Weights & Biases run, through ``wandb.init(reinit="create_new")`` (its
    own run object, whatever else the process logs to W&B).

    ``project``: the W&B project (``None``: the run's ``name``); ``mode``: ``online``,
    ``offline`` (written under ``<run_dir>/wandb``, sent later with ``wandb sync``) or
    ``disabled`` (``None``: W&B's default, ``WANDB_MODE``). Metrics are plotted against the
    torchkeel step (the ``step`` key), so the rows a resumed run logs again after its checkpoint
    do not break W&B's own increasing step. Incidents: a tag per kind (``incident:<kind>``) and
    each one's text in the summary. The run's id is kept in ``<run_dir>/wandb_run_id`` so that a
    resumed run continues it.
    """

    def __init__(
        self,
        run_dir: Path,
        config: dict[str, Any],
        *,
        project: str | None = None,
        mode: str | None = None,
        resume: bool = False,
    ) -> None:
        try:
            import wandb
        except ImportError:
            raise MissingExtraError("wandb", "wandb", "logging.wandb") from None
        id_file, saved = saved_run_id(run_dir, "wandb_run_id", resume)
        resumed = saved is not None
        run_id = saved or secrets.token_hex(6)
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, save_code=False)
        self.run = wandb.init(
            project=project or str(config.get("name") or "torchkeel"),
            name=Path(run_dir).name,
            id=run_id,
            resume="allow" if resumed else None,
            config=config,
            dir=str(run_dir),
            mode=mode,
            reinit="create_new",
            settings=settings,
        )
        id_file.write_text(run_id)
        self.run_dir, self.run_id, self.resumed = Path(run_dir), run_id, resumed
        self.run.define_metric("step", hidden=True)
        self.run.define_metric("*", step_metric="step")
        self.incidents = int(self.run.summary.get("torchkeel.incidents", 0) or 0) if resumed else 0

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **values})

    def last_step(self) -> int | None:
        """The highest ``step`` W&B holds of this run: the resumed run's summary (what W&B's server
        has) or the history in this run directory's own W&B files, offline or not. W&B's service
        keeps rows in memory until it writes them, so a killed process loses its latest rows."""
        held = [int(self.run.summary.get("step", -1) or -1)] if self.resumed else []
        for path in sorted(self.run_dir.glob(f"wandb/*-{self.run_id}/run-{self.run_id}.wandb")):
            held += history_steps(path)
        return max((s for s in held if s >= 0), default=None)

    def log_incident(self, row: dict[str, Any]) -> None:
        self.incidents += 1
        kind = str(row.get("kind"))
        tag = f"incident:{kind}"[:64]  # W&B's limit on a tag
        if tag not in self.run.tags:
            self.run.tags = (*self.run.tags, tag)
        text = f"step {row.get('step')} {kind}: {row.get('message', '')}"
        self.run.summary[f"torchkeel.incident.{self.incidents:04d}"] = text[:MAX_TAG]
        self.run.summary["torchkeel.incidents"] = self.incidents

    def finish(self, status: str | None) -> None:
        """End the W&B run with the torchkeel run's final ``status``: exit code 0 when it completed,
        marked preempting (W&B shows it preempted) when it was preempted or interrupted, else 1."""
        status = status or "completed"
        if status in PREEMPTED:
            self.run.mark_preempting()
        self.run.finish(exit_code=EXIT_CODES.get(status, 1))

    def close(self) -> None:
        self.finish(None)


BLOCK_BYTES, HEADER_BYTES = 32768, 7
FULL, LAST = 1, 4


def history_steps(path: Path) -> list[int]:
    """The ``step`` of every history record in a W&B transaction log (``run-<id>.wandb``).

    The file is a 7-byte header, then LevelDB-log blocks of 32 KiB; a record is one piece or
    several (first, middle, last), each behind a header of CRC (4 bytes), length (2), type (1).
    A record cut off by a killed process is left out.
    """
    from google.protobuf.message import DecodeError
    from wandb.proto.wandb_internal_pb2 import Record

    steps, data = [], path.read_bytes()
    for body in _log_records(data):
        record = Record()
        try:
            record.ParseFromString(body)
        except DecodeError:
            continue
        if record.WhichOneof("record_type") == "history":
            steps += [int(json.loads(item.value_json)) for item in record.history.item if item.key == "step"]
    return steps


def _log_records(data: bytes) -> Iterator[bytes]:
    body, pos = b"", HEADER_BYTES
    while pos + HEADER_BYTES <= len(data):
        block_left = BLOCK_BYTES - pos % BLOCK_BYTES
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if block_left < HEADER_BYTES or kind == 0:  # a block's zero-filled tail
            pos += block_left
            continue
        body += data[pos + HEADER_BYTES : pos + HEADER_BYTES + length]
        pos += HEADER_BYTES + length
        if kind in (FULL, LAST):
            yield body
            body = b""


def saved_run_id(run_dir: Path, name: str, resume: bool) -> tuple[Path, str | None]:
    """The file in the run directory that keeps the tracker's run id, and the id it holds when the
    torchkeel run resumes (``None``: a new tracker run)."""
    id_file = Path(run_dir) / name
    return id_file, (id_file.read_text().strip() if resume and id_file.is_file() else None)


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config → ``{"optim.lr": 0.001, ...}``."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
