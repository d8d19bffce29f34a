"""Ray Train: keel's Trainer in every worker of a ``TorchTrainer``.

Ray starts the workers, sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and creates the process
group before the training function runs; the Trainer adopts that group (it creates one only
when none exists) and reads the ranks as under torchrun. Checkpoints are torchkeel's own, in the
run directory, which must be on storage every worker sees; a worker that dies makes Ray restart
the group (``FailureConfig(max_failures=...)``) and the Trainer resumes from the newest
checkpoint (``--resume auto``). Every ``train`` and ``val`` row of ``metrics.jsonl`` goes to
``ray.train.report`` from every rank, as Ray requires (it is a barrier across workers).

    from torchkeel.integrations.ray import fit
    result = fit("cfg.yaml", ["optim.lr=3e-4"], num_workers=4, storage_path="/shared/ray")
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from torch.distributed import DistNetworkError

from torchkeel.config.load import load_config
from torchkeel.distributed.group import CollectiveTimeout
from torchkeel.errors import ConfigError, KeelError
from torchkeel.io import write_json_atomic

REPORTED = ("train", "val")
# Settings of the Ray that fit starts, so that the console holds keel's lines, each once, and
# Ray's errors. Ray Train's print patch logs every line a worker prints a second time, and its
# worker logging puts the root logger at INFO, which prints a line for each report. Ray's own
# loggers print INFO and WARNING lines in every process of the job, among them one a second from
# Ray Train's placement-group cleaner when the state API (not in ray[train] alone) does not answer.
RAY_WORKER_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "RAY_TRAIN_ENABLE_WORKER_STRUCTURED_LOGGING": "0"}
RAY_LOG_LEVEL = "ERROR"  # ray.LoggingConfig: the root and ray loggers of the driver and every worker


class RayJobFailed(KeelError):
    """Ray ended the job because a worker failed: the message names the rank, its machine and how."""


class RankFailed(RuntimeError):
    """A worker's error, with the machine it ran on (Ray's report names only the rank).

    ``after_peer``: the error followed another rank's end (a collective that lost its peer, or
    what failed while handling that): a consequence, never the rank that ended first.
    """

    def __init__(self, host: str, error: str, after_peer: bool = False) -> None:
        super().__init__(f"{error} (on {host})")
        self.host, self.error, self.after_peer = host, error, after_peer

    @classmethod
    def of(cls, error: BaseException) -> RankFailed:
        """This worker's ``error``, on this machine."""
        return cls(socket.gethostname(), f"{type(error).__name__}: {error}", after_peer(error))

    def __reduce__(self) -> tuple:
        return type(self), (self.host, self.error, self.after_peer)


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """The function each Ray worker runs: ``keel train CONFIG --resume auto`` in this process."""
    import ray.train

    from torchkeel.integrations.command import command_trainer

    for path in reversed(loop_config.get("sys_path", [])):
        if path not in sys.path:
            sys.path.insert(0, path)
    # Ray runs workers in a directory of its own: the config's relative paths (data files, a data
    # factory's own opens) mean what they meant where keel train was called, when that directory
    # is here too (one machine, or a shared filesystem mounted at the same path).
    if os.path.isdir(loop_config.get("cwd", "")):
        os.chdir(loop_config["cwd"])
    os.environ.update(loop_config.get("env", {}))
    config = load_config(loop_config["config"], list(loop_config.get("overrides", [])))
    trainer = command_trainer(config, resume="auto", progress=False)
    trainer.files.row_hooks.append(lambda row: _report(ray.train.report, row))
    try:
        summary = trainer.fit()
    except Exception as error:
        raise RankFailed.of(error) from error
    if summary.get("status") == "failed":
        raise RankFailed(socket.gethostname(), str(summary.get("error")))
    # The last report carries a small Ray checkpoint that points at keel's own (no copy of the
    # weights), so that Ray's Result has the run's summary and where its weights are.
    final = {k: v for k, v in summary.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    if trainer.rank.is_main:
        with tempfile.TemporaryDirectory() as pointer:
            (Path(pointer) / "summary.json").write_text(json.dumps(summary, default=str))
            ray.train.report(final, checkpoint=ray.train.Checkpoint.from_directory(pointer))
    else:
        ray.train.report(final)


def _report(report: Any, row: dict[str, Any]) -> None:
    if row.get("kind") in REPORTED:
        report(
            {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            | {"kind": row["kind"]}
        )


def fit(
    config: str | Path,
    overrides: list[str] | None = None,
    *,
    num_workers: int,
    address: str | None = None,
    storage_path: str | Path | None = None,
    max_failures: int = 3,
    use_gpu: bool = False,
    node_ip_address: str | None = None,
    worker_env: dict[str, str] | None = None,
) -> Any:
    """Train ``config`` on ``num_workers`` Ray workers; returns Ray's ``Result``.

    ``address``: an existing cluster (``ray.init(address=...)``); none starts a local one.
    ``storage_path``: Ray Train's own storage for the run's results (default: next to the run
    directory). ``max_failures``: how many times Ray restarts the worker group after a worker
    died (each restart resumes from the newest checkpoint; -1: without limit, 0: never).
    Workers run in this process's working directory where it exists on their machine, so that
    relative paths in the config mean the same to them. ``worker_env``: variables set in each
    worker before the Trainer starts. The run directory (``out_dir``) is made absolute here so
    that every worker writes the same place; on several machines it must be a shared filesystem.
    When no Ray is initialized in this process, ``ray.init`` gets ``RAY_WORKER_ENV`` and
    ``ray.LoggingConfig(log_level=RAY_LOG_LEVEL)``: keel's lines print once, Ray's errors only.
    A Ray initialized before keeps its own settings.
    """
    try:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer
    except ImportError:
        raise ConfigError("Ray is not installed: pip install 'ray[train]' (the --ray option needs it)") from None
    if num_workers < 1:
        raise ConfigError(f"--ray must be >= 1 workers, got {num_workers}")
    if max_failures < -1:
        raise ConfigError(f"--max-failures must be >= -1 (-1: without limit), got {max_failures}")
    overrides = list(overrides or [])
    cfg = load_config(str(config), overrides)  # a config error is said here, once, not by every worker
    out_dir = Path(cfg.out_dir).resolve()
    overrides.append(f"out_dir={out_dir}")
    python_path = _import_paths()
    if not ray.is_initialized():
        ray.init(
            address=address,
            include_dashboard=False,
            configure_logging=False,
            logging_config=ray.LoggingConfig(log_level=RAY_LOG_LEVEL),
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(python_path), **RAY_WORKER_ENV}},
            **({"_node_ip_address": node_ip_address} if node_ip_address else {}),
        )
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config": str(Path(config).resolve()),
            "overrides": overrides,
            "sys_path": python_path,
            "cwd": os.getcwd(),
            "env": dict(worker_env or {}),
        },
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        run_config=RunConfig(
            name=cfg.name,
            storage_path=str(Path(storage_path or out_dir / ".ray").resolve()),
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    return _run(trainer, out_dir / cfg.name)


def _import_paths() -> list[str]:
    """What the workers import the config's targets from, as this process does: its working
    directory and the import paths it added (not the interpreter's own)."""
    own = (sys.prefix, sys.base_prefix)
    return list(dict.fromkeys([os.getcwd(), *(p for p in sys.path if p and not p.startswith(own))]))


def _run(trainer: Any, run_dir: Path) -> Any:
    """``trainer.fit()``; a failure Ray names a worker for becomes ``RayJobFailed`` and the
    run's ``summary.json`` (when rank 0 wrote none)."""
    # Ray installs a SIGINT handler of its own for the fit and leaves it: the caller's comes back.
    previous, started = signal.getsignal(signal.SIGINT), time.time()
    try:
        return trainer.fit()
    except Exception as error:
        line = ended_first(error)
        if line is None:
            raise
        _summarize_failure(run_dir, line, started)
        raise RayJobFailed(line) from error
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, previous)


def ended_first(error: BaseException) -> str | None:
    """One line from Ray's failure report (``WorkerGroupError.worker_failures``): the rank that
    ended first, its machine and how it ended. None when Ray names no worker.

    The rank that ended first is the cause; an error another rank raised after it went away (a
    collective that lost its peer) is a consequence. So a rank's own error comes first, then a
    worker whose process died (it could raise nothing), then an error that followed a peer's end;
    among equals, the lowest rank.
    """
    failures = getattr(error, "worker_failures", None)
    if not failures:
        return None
    rank = min(failures, key=lambda r: (_standing(failures[r]), r))
    failure = failures[rank]
    if isinstance(failure, RankFailed):
        how = failure.error.splitlines()[0][:300]
        if _standing(failure) == _AFTER_PEER:  # every rank Ray names failed after another: it names no cause
            return f"rank {rank} on {failure.host} failed after another rank went away: {how}"
        return f"rank {rank} on {failure.host} ended first: {how}"
    text = str(failure)
    found = {
        key: match[1]
        for key, pattern in (
            ("host", r"hostname='([^']*)'"),
            ("pid", r"\bpid=(\d+)"),
            ("detail", r"Worker exit detail: ([^.]*)"),
            ("log", r"log_file_path='([^']*)'"),
        )
        if (match := re.search(pattern, text))
    }
    who = f"rank {rank}" + (f" ({found['host']}, pid {found.get('pid', '?')})" if "host" in found else "")
    if "actor died" in text or "detail" in found:
        how = f"its process died ({found.get('detail', 'no detail from Ray')}: a signal, the out-of-memory killer or a crash)"
    else:
        how = text.splitlines()[0][:300]
    return f"{who} ended first without an error of its own: {how}" + (
        f"; its log: {found['log']}" if "log" in found else ""
    )


_OWN_ERROR, _DIED, _AFTER_PEER = 0, 1, 2
# What a collective raises when the rank at its other end went away (gloo, NCCL; "ended first":
# keel's own line for it, in a failed rank's summary).
_PEER_GONE = re.compile(r"(closed|reset) by peer|remote process exited|ended first", re.IGNORECASE)


def _standing(failure: BaseException) -> int:
    """How a failure Ray reports stands as a cause: a rank's own error, a worker Ray lost (its
    process died), or an error that followed another rank's end."""
    if not isinstance(failure, RankFailed):
        return _DIED
    return _AFTER_PEER if failure.after_peer or _PEER_GONE.search(failure.error) else _OWN_ERROR


def after_peer(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from or while handling, is a collective that
    lost the rank at its other end (``CollectiveTimeout`` and the store's ``DistNetworkError``
    included): then ``error`` is a consequence of that rank's end (Ray may destroy the group
    while this rank is still handling it)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (CollectiveTimeout, DistNetworkError)) or _PEER_GONE.search(str(current)):
            return True
        current = current.__cause__ or current.__context__
    return False


def _summarize_failure(run_dir: Path, line: str, started: float) -> None:
    """Write ``summary.json`` for a job Ray tore down before rank 0 could (rank 0's own summary
    of this fit is kept)."""
    summary = run_dir / "summary.json"
    if run_dir.is_dir() and not (summary.exists() and summary.stat().st_mtime >= started):
        write_json_atomic(summary, {"status": "failed", "error": line})
