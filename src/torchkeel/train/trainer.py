"""The Trainer: a thin loop over the components — build, steps, validate, log, summarize.

The order of a training step is in ``torchkeel.train.step.train_step``; this file only decides
when to step, validate and log, and writes the run files (from rank 0 only).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from torchkeel.config.load import to_dict
from torchkeel.config.schema import KeelConfig
from torchkeel.data.loader import EpochLoader
from torchkeel.dist.rank import RankInfo
from torchkeel.io import write_json_atomic, write_text_atomic
from torchkeel.train.accumulate import iter_groups, total_steps
from torchkeel.train.build import build_datasets, build_loss, build_model, resolve_device
from torchkeel.train.compile import CompiledOrEager
from torchkeel.train.metrics import MetricsWriter, Progress
from torchkeel.train.optim import build_optimizer
from torchkeel.train.precision import make_precision
from torchkeel.train.rundir import prepare_run_dir
from torchkeel.train.schedule import build_scheduler
from torchkeel.train.seed import seed_everything
from torchkeel.train.step import train_step
from torchkeel.train.validate import evaluate


class Trainer:
    """Trains the model a ``KeelConfig`` describes, with every protection on.

    Objects passed in (``model``, ``train_data``/``val_data``, ``loss_fn``) take the place of
    the config's import paths. Build order — seed, data, model, loss, optimizer — is fixed, so a
    hand-written loop that follows it draws the same random numbers.

    Example::

        summary = Trainer(load_config("cfg.yaml")).fit()
        print(summary["val_accuracy"])
    """

    def __init__(
        self,
        config: KeelConfig,
        *,
        model: torch.nn.Module | None = None,
        train_data: Any = None,
        val_data: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        overwrite: bool = False,
        progress: bool = True,
    ) -> None:
        self.config = cfg = config.validate()
        self.rank = RankInfo.from_env()
        self.device = resolve_device(cfg.device, self.rank)
        self.precision = make_precision(cfg.precision, self.device)
        seed_everything(cfg.seed, cfg.deterministic)
        if train_data is None:
            train_data, val_data = build_datasets(cfg.data)
        self.model = (model if model is not None else build_model(cfg.model)).to(self.device)
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
        self.overwrite = overwrite
        self.show_progress = progress

    def fit(self) -> dict[str, Any]:
        """Train to the configured limit; return the summary that is also written to ``summary.json``."""
        cfg, is_main = self.config, self.rank.is_main
        if is_main:
            prepare_run_dir(cfg.out_dir, cfg.name, overwrite=self.overwrite)
            write_text_atomic(self.run_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
        self._metrics = MetricsWriter(self.run_dir / "metrics.jsonl") if is_main else None
        self._progress = Progress(self.total_steps, enabled=self.show_progress and is_main)
        self._start = time.perf_counter()
        self.step, self.epoch = 0, 0
        summary: dict[str, Any] = {"status": "failed"}
        try:
            val_metrics = self._train()
            summary = {"status": "completed", **val_metrics}
        except KeyboardInterrupt:
            summary = {"status": "interrupted"}
            raise
        except Exception as exc:
            summary = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
            raise
        finally:
            summary = self._finish(summary)
        return summary

    def _train(self) -> dict[str, float]:
        train, val_metrics, validated_at = self.config.train, {}, -1
        window_samples, window_start = 0, time.perf_counter()
        while self.step < self.total_steps:
            for group in iter_groups(self.train_loader.epoch(self.epoch), train.accumulate):
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
                window_samples += result.num_samples
                self._progress.advance(1)
                if is_log:
                    loss, grad_norm = result.loss.item(), result.grad_norm.item()  # host sync: log steps only
                    now = time.perf_counter()
                    self._log({
                        "kind": "train", "step": self.step, "epoch": self.epoch, "loss": loss, "lr": lr,
                        "grad_norm": grad_norm, "samples_per_s": window_samples / max(now - window_start, 1e-9),
                    })
                    window_samples, window_start = 0, time.perf_counter()
                if train.val_every and self.step % train.val_every == 0:
                    val_metrics, validated_at = self._validate(), self.step
            else:
                if not train.val_every:
                    val_metrics, validated_at = self._validate(), self.step
                self.epoch += 1
        if validated_at != self.step:
            val_metrics = self._validate()
        return val_metrics

    def _validate(self) -> dict[str, float]:
        if self.val_loader is None:
            return {}
        metrics = evaluate(
            self.model, self.val_loader.epoch(0), self.loss_fn, device=self.device, precision=self.precision
        )
        self._log({"kind": "val", "step": self.step, "epoch": self.epoch, **metrics})
        return metrics

    def _log(self, row: dict[str, Any]) -> None:
        row["wall_s"] = round(time.perf_counter() - self._start, 4)
        if self._metrics is not None:
            self._metrics.write(row)
        self._progress.log(row)

    def _finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        self._progress.close()
        summary = {
            **summary, "steps": self.step, "epochs": self.epoch,
            "wall_s": round(time.perf_counter() - self._start, 3), "run_dir": str(self.run_dir),
        }
        if self._metrics is not None:
            self._metrics.close()
            write_json_atomic(self.run_dir / "summary.json", summary)
        return summary
