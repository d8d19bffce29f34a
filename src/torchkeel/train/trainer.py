"""The Trainer: a thin loop over the components — resume, steps, validate, checkpoint, log.

The order of a training step is in ``torchkeel.train.step.train_step``; this file only decides
when to step, validate, save and stop, and writes the run files (from rank 0 only).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from torchkeel.checkpoint import (
    AsyncSaver, Checkpoint, CheckpointStore, capture_training_state, load_model_weights, load_weights,
    restore_training_state,
)
from torchkeel.checkpoint.format import PointHook
from torchkeel.config.load import config_hash, to_dict
from torchkeel.config.schema import KeelConfig
from torchkeel.data.loader import EpochLoader
from torchkeel.dist import RankInfo, any_rank
from torchkeel.io import write_json_atomic, write_text_atomic
from torchkeel.provenance import provenance
from torchkeel.train.accumulate import iter_groups, total_steps
from torchkeel.train.build import build_datasets, build_loss, build_model, resolve_device
from torchkeel.train.compile import CompiledOrEager
from torchkeel.train.metrics import MetricsWriter, Progress
from torchkeel.train.optim import build_optimizer
from torchkeel.train.precision import make_precision
from torchkeel.train.preempt import StopSignals
from torchkeel.train.resume import find_checkpoint, truncate_metrics
from torchkeel.train.rundir import prepare_run_dir
from torchkeel.train.schedule import build_scheduler
from torchkeel.train.seed import seed_everything
from torchkeel.train.step import train_step
from torchkeel.train.validate import evaluate

# The counters a checkpoint carries, so a resumed run continues with the very next batch.
PROGRESS = ("step", "epoch", "batch_in_epoch", "samples", "val_metrics", "validated_at", "saved_at")


class Trainer:
    """Trains the model a ``KeelConfig`` describes, with every protection on.

    Objects passed in (``model``, ``train_data``/``val_data``, ``loss_fn``) take the place of
    the config's import paths. Build order — seed, data, model, loss, optimizer — is fixed, so a
    hand-written loop that follows it draws the same random numbers. ``resume`` is ``"auto"``
    (the newest valid checkpoint of the run, or a fresh start) or a checkpoint directory.

    Example::

        summary = Trainer(load_config("cfg.yaml"), resume="auto").fit()
        print(summary["status"], summary["val_accuracy"])
    """

    def __init__(
        self,
        config: KeelConfig,
        *,
        model: torch.nn.Module | None = None,
        train_data: Any = None,
        val_data: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        resume: str | Path | None = None,
        overwrite: bool = False,
        progress: bool = True,
        checkpoint_hook: PointHook | None = None,
    ) -> None:
        self.config = cfg = config.validate()
        self.rank = RankInfo.from_env()
        self.device = resolve_device(cfg.device, self.rank)
        self.precision = make_precision(cfg.precision, self.device)
        seed_everything(cfg.seed, cfg.deterministic)
        if train_data is None:
            train_data, val_data = build_datasets(cfg.data)
        self.model = (model if model is not None else build_model(cfg.model)).to(self.device)
        if cfg.model.init_from:
            self._init_weights(cfg.model.init_from, cfg.model.init_strict)
        self.forward_model = CompiledOrEager(self.model) if cfg.compile else self.model
        self.loss_fn = loss_fn if loss_fn is not None else build_loss(cfg.loss)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(cfg.optim, self.params)
        pin = self.device.type == "cuda"
        self.train_loader = EpochLoader(
            train_data, cfg.train.batch_size, seed=cfg.seed, shuffle=cfg.data.shuffle,
            num_workers=cfg.data.num_workers, pin_memory=pin,
        )
        self.val_loader = None if val_data is None else EpochLoader(
            val_data, cfg.train.batch_size, shuffle=False, num_workers=cfg.data.num_workers, pin_memory=pin
        )
        self.total_steps = total_steps(
            len(self.train_loader), cfg.train.accumulate, cfg.train.max_epochs, cfg.train.max_steps
        )
        self.scheduler = build_scheduler(
            self.optimizer, warmup_steps=cfg.schedule.warmup_steps, total_steps=self.total_steps,
            decay=cfg.schedule.decay, min_lr=cfg.schedule.min_lr,
        )
        self.run_dir = Path(cfg.out_dir) / cfg.name
        ck = cfg.checkpoint
        self.store = CheckpointStore(
            self.run_dir / "checkpoints", keep_last=ck.keep_last, save_top_k=ck.save_top_k,
            monitor=ck.monitor, mode=ck.mode, hook=checkpoint_hook,
        )
        self.saver = AsyncSaver(self.store) if ck.async_save else None
        self.resume, self.overwrite, self.show_progress = resume, overwrite, progress
        # Progress counters: all a resumed run needs to continue with the very next batch.
        self.step = self.epoch = self.batch_in_epoch = self.samples = 0
        self.val_metrics: dict[str, float] = {}
        self.validated_at = self.saved_at = -1

    def fit(self) -> dict[str, Any]:
        """Train to the configured limit; return the summary that is also written to ``summary.json``.

        ``status`` is ``completed``, ``preempted`` (SIGTERM/SIGINT: checkpoint written, see
        ``signal``), ``failed`` (with ``error``) or ``interrupted`` (a second Ctrl-C).
        """
        cfg, is_main = self.config, self.rank.is_main
        self._progress = Progress(self.total_steps, enabled=self.show_progress and is_main)
        found = find_checkpoint(self.store, self.resume, self._progress.warn) if self.resume else None
        if is_main:
            prepare_run_dir(cfg.out_dir, cfg.name, overwrite=self.overwrite, resume=self.resume is not None)
            write_text_atomic(self.run_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
            truncate_metrics(self.run_dir / "metrics.jsonl", found.step if found else 0)
        self._metrics = MetricsWriter(self.run_dir / "metrics.jsonl") if is_main else None
        self._provenance = provenance(config_hash(cfg))
        self._start = time.perf_counter()
        if found is not None:
            self._restore(found)
            self._log({"kind": "resume", "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                       "samples": self.samples, "checkpoint": str(found.path)})
        summary: dict[str, Any] = {"status": "failed"}
        try:
            with StopSignals() as self._signals:
                self._train()
            if self.saver is not None:
                self.saver.wait()  # the final save is on disk before the run reports done
            summary = {"status": "preempted", "signal": self._signals.name} if self._signals.requested else {"status": "completed"}
        except KeyboardInterrupt:
            summary = {"status": "interrupted"}
            raise
        except Exception as exc:
            summary = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
            raise
        finally:
            summary = self._finish(summary)
        return summary

    def _train(self) -> None:
        train, num_batches = self.config.train, len(self.train_loader)
        window_samples, window_start = 0, time.perf_counter()
        while self.step < self.total_steps:
            batches = self.train_loader.epoch(self.epoch, start_batch=self.batch_in_epoch)
            for group in iter_groups(batches, train.accumulate):
                if self.step >= self.total_steps:
                    break
                is_log = (self.step + 1) % train.log_every == 0 or self.step + 1 == self.total_steps
                lr = self.optimizer.param_groups[0]["lr"] if is_log else 0.0
                result = train_step(
                    self.forward_model, self.optimizer, group, self.loss_fn, params=self.params,
                    precision=self.precision, device=self.device,
                    clip_grad_norm_max=train.clip_grad_norm, scheduler=self.scheduler,
                )
                self.step += 1
                self.batch_in_epoch += len(group)
                self.samples += result.num_samples
                window_samples += result.num_samples
                self._progress.advance(1)
                if is_log:
                    loss, grad_norm = result.loss.item(), result.grad_norm.item()  # host sync: log steps only
                    now = time.perf_counter()
                    self._log({
                        "kind": "train", "step": self.step, "epoch": self.epoch, "loss": loss, "lr": lr,
                        "grad_norm": grad_norm, "samples": self.samples,
                        "samples_per_s": window_samples / max(now - window_start, 1e-9),
                    })
                    window_samples, window_start = 0, time.perf_counter()
                if train.val_every and self.step % train.val_every == 0:
                    self._validate()
                every = self.config.checkpoint.every_steps
                if every and self.step % every == 0 and self.batch_in_epoch < num_batches:
                    self._save()  # at an epoch's end the epoch-end save follows instead
                if any_rank(self._signals.requested is not None, self.device):
                    self._save()
                    return
            else:
                if not train.val_every:
                    self._validate()
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                self._save()
        if self.validated_at != self.step:
            self._validate()
        self._save()

    def _validate(self) -> None:
        self.validated_at = self.step
        if self.val_loader is None:
            return
        self.val_metrics = evaluate(
            self.model, self.val_loader.epoch(0), self.loss_fn, device=self.device, precision=self.precision
        )
        self._log({"kind": "val", "step": self.step, "epoch": self.epoch, **self.val_metrics})

    def _save(self) -> None:
        """Checkpoint the current state (rank 0 writes); once per step at most."""
        if not self.config.checkpoint.enabled or self.saved_at == self.step or not self.rank.is_main:
            return
        self.saved_at = self.step
        progress = {name: getattr(self, name) for name in PROGRESS}
        state = capture_training_state(self.model, self.optimizer, self.scheduler, self.precision.scaler, progress)
        kwargs = {"step": self.step, "epoch": self.epoch, "metrics": self.val_metrics, "meta": self._provenance}
        if self.saver is not None:
            self.saver.save(state, **kwargs)
        else:
            self.store.save(state, **kwargs)

    def _restore(self, found: Checkpoint) -> None:
        progress = restore_training_state(found.state, self.model, self.optimizer, self.scheduler, self.precision.scaler)
        for name in PROGRESS:
            setattr(self, name, progress[name])
        if found.manifest.get("config_hash") != self._provenance["config_hash"]:
            self._progress.warn(f"the config differs from the one checkpoint '{found.path}' was saved with")

    def _init_weights(self, path: str, strict: bool) -> None:
        skipped = load_model_weights(self.model, load_weights(path), strict=strict, source=f"weights in '{path}'")
        if skipped:
            print(f"keel: warning: model.init_from '{path}': not loaded: {', '.join(skipped)}", file=sys.stderr)

    def _log(self, row: dict[str, Any]) -> None:
        row["wall_s"] = round(time.perf_counter() - self._start, 4)
        if self._metrics is not None:
            self._metrics.write(row)
        self._progress.log(row)

    def _finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        if self.saver is not None:
            self.saver.join()  # a save in flight is a complete state: let it land
        self._progress.close()
        summary = {
            **summary, **self.val_metrics,
            "steps": self.step, "epochs": self.epoch, "samples": self.samples,
            "wall_s": round(time.perf_counter() - self._start, 3), "run_dir": str(self.run_dir),
        }
        if self._metrics is not None:
            self._metrics.close()
            write_json_atomic(self.run_dir / "summary.json", summary)
        return summary
