"""Validation of a ``KeelConfig``: every check names the key to change. One function per part
of the config, called in the config's order by ``check_config`` (``KeelConfig.validate``)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

from torchkeel.config.preprocess import parse_preprocess
from torchkeel.errors import ConfigError


def check_config(cfg: Any) -> None:
    """Raise ``ConfigError`` for the first value or combination of ``cfg`` that cannot run."""
    _check_train(cfg)
    _check_model(cfg)
    _check_data(cfg)
    _check_optim(cfg)
    _check_checkpoint(cfg)
    _check_protections(cfg)
    _check_metrics(cfg)
    _check_logging(cfg)


def _check_train(cfg: Any) -> None:
    """train.*: sizes, cadences, early stopping, EMA."""
    t = cfg.train
    _positive("train.batch_size", t.batch_size)
    _positive("train.accumulate", t.accumulate)
    _positive("train.log_every", t.log_every)
    _at_least("train.val_every", t.val_every, 0)
    _check_val(cfg.val, t)
    _at_least("train.early_stop.patience", t.early_stop.patience, 0)
    _at_least("train.early_stop.min_delta", t.early_stop.min_delta, 0)
    if not 0 <= t.ema.decay < 1:
        raise ConfigError(f"train.ema.decay must be in [0, 1) (0: off), got {t.ema.decay}")
    _at_least("train.ema.start_step", t.ema.start_step, 0)
    if t.ema.decay and cfg.dist.strategy == "fsdp":
        raise ConfigError(
            "train.ema does not work with dist.strategy=fsdp yet (the average would need the "
            "full weights on every rank); use dist.strategy=ddp or set train.ema.decay=0"
        )
    if t.carry.enabled and cfg.data.shuffle:
        raise ConfigError(
            "train.carry.enabled is true and data.shuffle is true: a carried state continues each batch's rows "
            "into the next batch, which needs the batches in their order; set data.shuffle: false"
        )
    if t.carry.enabled and cfg.loss.step_fn is None:
        raise ConfigError(
            "train.carry.enabled is true but loss.step_fn is not set; set loss.step_fn to a "
            "step_fn(model, batch, state) that returns torchkeel.StepOutput(loss, state=new_state)"
        )


def _check_val(v: Any, t: Any) -> None:
    """val.*: sizes and cadence; ``train.val_every`` is the old name of ``val.every_steps``."""
    _at_least("val.every_steps", v.every_steps, 0)
    if v.every_steps and t.val_every:
        raise ConfigError("val.every_steps and train.val_every (its old name) are both set; keep val.every_steps")
    if v.batch_size is not None:
        _positive("val.batch_size", v.batch_size)
    if v.max_batches is not None:
        _positive("val.max_batches", v.max_batches)


def _check_model(cfg: Any) -> None:
    """model.*, activation checkpointing and profiling: one way to build and run it."""
    if cfg.train.activation_checkpointing not in (False, []) and cfg.dist.activation_checkpointing:
        raise ConfigError(
            "train.activation_checkpointing and dist.activation_checkpointing (its old name) are both set; keep "
            "train.activation_checkpointing"
        )
    steps = cfg.profile.steps
    if steps and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
        raise ConfigError(
            f"profile.steps must be [start, end] with 1 <= start <= end (steps count from 1), got {steps}"
        )
    if cfg.model.hf is not None and cfg.model.target is not None:
        raise ConfigError(
            f"model.target={cfg.model.target!r} and model.hf are both set; keep one (model.target=null "
            "to train the transformers model)"
        )
    masked = cfg.model.hf is not None and cfg.model.hf.task == "masked-lm"
    if masked and cfg.data.mlm_probability is None:
        raise ConfigError(
            "model.hf.task=masked-lm learns to fill in masked tokens: set data.mlm_probability (BERT uses 0.15) "
            "with data.format=text"
        )


def _check_data(cfg: Any) -> None:
    """data.*: workers, streams, padding, preprocess, and what each format accepts."""
    d = cfg.data
    if d.num_workers != "auto":
        _at_least("data.num_workers", d.num_workers, 0)
    _positive("data.prefetch_factor", d.prefetch_factor)
    _positive("data.bucket_window", d.bucket_window)
    _at_least("data.shuffle_buffer", d.shuffle_buffer, 0)
    _positive("data.streams", d.streams)
    if isinstance(d.pad_value, dict):
        for key, value in d.pad_value.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"data.pad_value.{key} must be a number, got {value!r}")
    if d.preprocess.mode is not None:
        parse_preprocess(dataclasses.asdict(d.preprocess), "data.preprocess")
    elif d.preprocess != type(d.preprocess)():
        raise ConfigError("data.preprocess is set but data.preprocess.mode is null; set mode: RGB or L")
    if not 0 <= d.max_bad_fraction <= 1:
        raise ConfigError(f"data.max_bad_fraction must be in [0, 1], got {d.max_bad_fraction}")
    if d.format == "map" and d.train is not None:
        raise ConfigError("data.train is for streaming formats; set data.format=parquet, webdataset or text")
    if d.format == "parquet" and d.input is None and not d.columns and d.train is not None:
        raise ConfigError(
            "data.format=parquet needs data.input (the feature columns, or one list-valued column) "
            "or data.columns (the columns of dict samples)"
        )
    if d.columns and (d.format not in ("parquet", "datasets") or d.input is not None or d.target is not None):
        raise ConfigError(
            "data.columns makes dict samples of Parquet or datasets columns: use it with data.format=parquet or datasets, "
            "without data.input and data.target (name the label column among data.columns)"
        )
    if d.format == "webdataset" and d.bucket_by is not None:
        raise ConfigError(
            "data.bucket_by works with parquet and map-style data; for webdataset, "
            "write shards grouped by length or drop data.bucket_by"
        )
    if d.batch_transform is not None and d.format not in ("parquet", "text"):
        raise ConfigError("data.batch_transform applies to parquet and text row blocks; use data.transform per sample")
    if d.format == "text":
        _check_text(d)
    if d.mlm_probability is not None and d.format != "text":
        raise ConfigError(
            f"data.mlm_probability masks the tokens of data.format=text, not of format {d.format}; mask them "
            "in your dataset, or train from text files"
        )
    if d.format == "datasets" and not d.columns:
        raise ConfigError("data.format=datasets needs data.columns: the columns of each sample ([input_ids, labels])")


def _check_text(d: Any) -> None:
    """data.* of ``format: text``: block size, packing, and the keys that belong to other formats."""
    _positive("data.block_size", d.block_size)
    _positive("data.chunk_bytes", d.chunk_bytes)
    for name in ("input", "target", "image", "bucket_by"):
        if getattr(d, name) is not None:
            raise ConfigError(
                f"data.{name} is not used by data.format=text (samples are input_ids and labels); remove it"
            )
    if not d.pack and d.collate == "default":
        raise ConfigError(
            "data.pack=false makes a sample of each document, of different lengths; set data.collate: pad"
        )


def _check_optim(cfg: Any) -> None:
    """optim.*, schedule.*, the training limit, clipping and the run name."""
    t = cfg.train
    _at_least("schedule.warmup_steps", cfg.schedule.warmup_steps, 0)
    _at_least("optim.weight_decay", cfg.optim.weight_decay, 0)
    _at_least("schedule.min_lr", cfg.schedule.min_lr, 0)
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr must be > 0, got {cfg.optim.lr}")
    if cfg.schedule.min_lr > cfg.optim.lr:
        raise ConfigError(
            f"schedule.min_lr ({cfg.schedule.min_lr}) is above optim.lr ({cfg.optim.lr}); "
            "set schedule.min_lr <= optim.lr"
        )
    _check_schedule(cfg.schedule)
    for i, group in enumerate(cfg.optim.groups):
        if not group.params:
            raise ConfigError(f"optim.groups[{i}].params is empty: give a name pattern such as 'lm_head.*'")
        if group.lr is not None and group.lr < 0:
            raise ConfigError(f"optim.groups[{i}].lr must be >= 0, got {group.lr}")
        if group.weight_decay is not None:
            _at_least(f"optim.groups[{i}].weight_decay", group.weight_decay, 0)
    if t.max_epochs is None and t.max_steps is None:
        raise ConfigError("set train.max_epochs or train.max_steps: training needs a limit")
    if t.max_epochs is not None:
        _positive("train.max_epochs", t.max_epochs)
    if t.max_steps is not None:
        _positive("train.max_steps", t.max_steps)
    if t.clip_grad_norm is not None and t.clip_grad_norm <= 0:
        raise ConfigError(f"train.clip_grad_norm must be > 0 or null (no clipping), got {t.clip_grad_norm}")
    if not cfg.name or "/" in cfg.name or cfg.name in (".", ".."):
        raise ConfigError(f"name {cfg.name!r} is not a valid run name; use letters, digits, '-', '_'")


def _check_schedule(s: Any) -> None:
    """schedule.*: the built-in decay's keys, or a ``target`` with its stepping keys, not both."""
    if s.decay_steps is not None:
        _at_least("schedule.decay_steps", s.decay_steps, 1)
    if s.target is None:
        extra = [k for k, set_ in (("args", s.args), ("monitor", s.monitor), ("mode", s.mode)) if set_]
        extra += ["interval"] if s.interval != "step" else []
        if extra:
            raise ConfigError(
                f"schedule.{extra[0]} belongs to a schedule.target (e.g. torch.optim.lr_scheduler:StepLR); "
                f"set schedule.target or remove schedule.{extra[0]} (the built-in schedule steps per optimizer step)"
            )
        return
    built_in = [
        k for k, set_ in (("decay", s.decay != "cosine"), ("min_lr", s.min_lr), ("decay_steps", s.decay_steps)) if set_
    ]
    if built_in:
        raise ConfigError(
            f"schedule.{built_in[0]} shapes the built-in decay, which schedule.target={s.target!r} replaces; "
            f"remove schedule.{built_in[0]} (give the target its own settings under schedule.args)"
        )
    if s.mode is not None and s.monitor is None:
        raise ConfigError("schedule.mode goes with schedule.monitor (the metric it judges); set both or neither")
    if s.monitor is not None and s.monitor != "train_loss" and not s.monitor.startswith("val_"):
        raise ConfigError(
            f"schedule.monitor={s.monitor!r} is not a metric the run reports to a schedule; use a validation "
            "metric (val_loss, val_accuracy, val_<name> of metrics) or train_loss (the epoch's mean training loss)"
        )


def _check_checkpoint(cfg: Any) -> None:
    """checkpoint.*: cadence, retention, overhead."""
    _at_least("checkpoint.every_steps", cfg.checkpoint.every_steps, 0)
    _positive("checkpoint.keep_last", cfg.checkpoint.keep_last)
    _at_least("checkpoint.save_top_k", cfg.checkpoint.save_top_k, 0)
    _at_least("checkpoint.every_s", cfg.checkpoint.every_s, 0)
    if not 0 < cfg.checkpoint.max_overhead <= 1:
        raise ConfigError(f"checkpoint.max_overhead must be in (0, 1], got {cfg.checkpoint.max_overhead}")


def _check_protections(cfg: Any) -> None:
    """guard.*, memory.*, dist.* timeouts."""
    g, m = cfg.guard, cfg.memory
    _positive("guard.max_consecutive", g.max_consecutive)
    _at_least("guard.max_rollbacks", g.max_rollbacks, 0)
    _at_least("guard.snapshot_every", g.snapshot_every, 0)
    if not 0 < g.lr_backoff <= 1:
        raise ConfigError(f"guard.lr_backoff must be in (0, 1], got {g.lr_backoff}")
    if g.spike_factor is not None and g.spike_factor <= 1:
        raise ConfigError(f"guard.spike_factor must be > 1 or null, got {g.spike_factor}")
    _at_least("memory.every_steps", m.every_steps, 0)
    _positive("memory.leak_every_steps", m.leak_every_steps)
    if m.leak_max_overhead <= 0:
        raise ConfigError(f"memory.leak_max_overhead must be > 0, got {m.leak_max_overhead}")
    _at_least("memory.leak_warmup_steps", m.leak_warmup_steps, 0)
    _at_least("memory.leak_window", m.leak_window, 2)
    if not 0 < m.warn_cuda_fraction <= 1:
        raise ConfigError(f"memory.warn_cuda_fraction must be in (0, 1], got {m.warn_cuda_fraction}")
    if cfg.dist.init_timeout_s <= 0 or cfg.dist.timeout_s <= 0:
        raise ConfigError("dist.init_timeout_s and dist.timeout_s must be > 0 (seconds)")


def _check_metrics(cfg: Any) -> None:
    """metrics[*] and device/precision combinations."""
    names = [m.name for m in cfg.metrics]
    for i, m in enumerate(cfg.metrics):
        if not m.name.isidentifier():
            raise ConfigError(f"metrics[{i}].name must be a name like f1 (logged as val_<name>), got {m.name!r}")
        if not m.target:
            raise ConfigError(
                f"metrics[{i}].target is missing: give 'module:Class', "
                "e.g. torchmetrics.classification:MulticlassF1Score"
            )
        if not m.on:
            raise ConfigError(f"metrics[{i}].on is empty: give [val], [train] or [val, train]")
        if m.name in ("loss", "accuracy") or names.count(m.name) > 1:
            raise ConfigError(
                f"metrics[{i}].name {m.name!r} is taken (val_loss, val_accuracy or another metric): choose another name"
            )
    if cfg.device == "cpu" and cfg.precision == "fp16":
        raise ConfigError("precision fp16 needs a CUDA device; use precision=bf16 on CPU")


DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
"""MLflow's database stores: they need SQLAlchemy and Alembic, which ``mlflow-skinny`` lacks."""


def _check_logging(cfg: Any) -> None:
    """logging.mlflow: a store the installed MLflow can open, known before the run writes anything."""
    ml = cfg.logging.mlflow
    if ml is None or not _installed("mlflow"):
        return  # without MLflow the logger names the extra to install
    key, uri = "logging.mlflow.tracking_uri", ml.tracking_uri
    if uri is None and os.environ.get("MLFLOW_TRACKING_URI"):
        key, uri = "logging.mlflow.tracking_uri (null: MLFLOW_TRACKING_URI)", os.environ["MLFLOW_TRACKING_URI"]
    if uri is None:
        import mlflow

        uri, key = mlflow.get_tracking_uri(), "logging.mlflow.tracking_uri (null: MLflow's default)"
    scheme = uri.split(":", 1)[0].split("+", 1)[0] if ":" in uri else ""
    if scheme in DATABASE_SCHEMES:
        missing = [name for name in ("sqlalchemy", "alembic") if not _installed(name)]
        if missing:
            raise ConfigError(
                f"{key} {uri!r} is a database store, and MLflow cannot open it without "
                f"{' and '.join(missing)}: pip install 'torchkeel[mlflow]' (or pip install mlflow), or "
                "give a server (http://host:5000) or file:./mlruns with MLFLOW_ALLOW_FILE_STORE=true"
            )
    elif scheme in ("", "file") or len(scheme) == 1:  # a path (C:\ on Windows) or file:
        from mlflow import environment_variables

        allow = getattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)
        if allow is not None and not allow.get():
            raise ConfigError(
                f"{key} {uri!r} is a file store, which this MLflow opens only with the environment "
                "variable MLFLOW_ALLOW_FILE_STORE=true: set it, or use sqlite:///mlflow.db or a server"
            )


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules (blocked)
        return False


def _positive(key: str, value: int) -> None:
    _at_least(key, value, 1)


def _at_least(key: str, value: float, low: float) -> None:
    if value < low:
        raise ConfigError(f"{key} must be >= {low}, got {value}")
