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
from torchkeel.checkpoint.state import capture_rng, restore_rng
from torchkeel.checkpoint.format import PointHook
from torchkeel.config.load import config_hash, to_dict
from torchkeel.config.schema import KeelConfig
from torchkeel.data.build import build_loaders
from torchkeel.data.stream import StreamLoader
from torchkeel.distributed import RankInfo, any_rank, any_rank_flags
from torchkeel.distributed.checkpoint import load_sharded, save_sharded
from torchkeel.distributed.job import DataParallel
from torchkeel.io import write_json_atomic, write_text_atomic
from torchkeel.provenance import provenance
from torchkeel.train.accumulate import Lookahead, iter_groups, total_steps
from torchkeel.train.cadence import SaveCadence
from torchkeel.train.build import build_model, build_objective, resolve_device
from torchkeel.errors import CheckpointError, TrainingDiverged
from torchkeel.train.compile import CompiledOrEager
from torchkeel.train.diagnose import diagnose_nonfinite
from torchkeel.train.early_stop import EarlyStopping
from torchkeel.train.ema import WeightAverage
from torchkeel.train.guards import Action, NonFiniteGuard, Snapshot, SpikeDetector, apply_lr_scale
from torchkeel.train.incidents import IncidentLog
from torchkeel.train.inputbound import InputBoundDetector, TimedBatches
from torchkeel.train.memory import LeakDetector, MemoryMonitor, MemoryProbe
from torchkeel.train.objective import LabelOutOfRange
from torchkeel.train.loggers import RunLoggers
from torchkeel.train.metrics import MetricsWriter, Progress
from torchkeel.train.metricset import MetricSet
from torchkeel.train.optim import build_optimizer
from torchkeel.train.precision import make_precision
from torchkeel.train.preempt import StopSignals
from torchkeel.train.resume import check_resume_config, find_checkpoint, truncate_metrics
from torchkeel.train.rundir import PreviousRun, prepare_run_dir
from torchkeel.train.schedule import build_scheduler, end_at_floor
from torchkeel.train.seed import seed_everything
from torchkeel.train.step import train_step
from torchkeel.train.validate import evaluate

MAX_SHOWN_BAD = 10_000  # bad samples a checkpoint remembers as printed (beyond: printed again after a resume)

# The counters a checkpoint carries, so a resumed run continues with the very next batch.
PROGRESS = ("step", "epoch", "batch_in_epoch", "samples", "val_metrics", "validated_at", "saved_at",
            "micro_batch_size", "diagnosis", "early_stop")


class Trainer:
    """Trains the model a ``KeelConfig`` describes, with every protection on.

    Objects passed in (``model``, ``train_data``/``val_data`` — map-style datasets or streaming
    sources —, ``loss_fn``) take the place of the config's import paths. Build order — seed, data, model, loss, optimizer — is fixed, so a
    hand-written loop that follows it draws the same random numbers. ``resume`` is ``"auto"``
    (the newest valid checkpoint of the run, or a fresh start) or a checkpoint directory; a
    config that differs from the checkpoint's in what the run computes (data, model, batch,
    seed…) is refused unless ``allow_config_change`` (see ``check_resume_config``).

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
        allow_config_change: bool = False,
        overwrite: bool = False,
        progress: bool = True,
        checkpoint_hook: PointHook | None = None,
        oom_hook: Callable[[int], None] | None = None,
        memory_probe: MemoryProbe | None = None,
    ) -> None:
        self.config = cfg = config.validate()
        self.rank = RankInfo.from_env()
        self.device = resolve_device(cfg.device, self.rank)
        self.precision = make_precision(cfg.precision, self.device)
        self.job = DataParallel(cfg.dist, self.rank, self.device)  # joins the job under torchrun
        try:
            self._build(cfg, model, train_data, val_data, loss_fn)
        except BaseException:
            self.job.close()
            raise
        ck = cfg.checkpoint
        self.store = CheckpointStore(
            self.run_dir / "checkpoints", keep_last=ck.keep_last, save_top_k=ck.save_top_k,
            monitor=ck.monitor, mode=ck.mode, hook=checkpoint_hook,
        )
        # Sharded saves are collective: every rank writes its shards at the same time.
        self.saver = AsyncSaver(self.store) if ck.async_save and not self.job.sharded else None
        self.cadence = SaveCadence(ck.every_s, ck.max_overhead)
        g, mem = cfg.guard, cfg.memory
        self.guard = NonFiniteGuard(g.on_nonfinite, g.max_consecutive, g.lr_backoff, g.max_rollbacks)
        self.spikes = SpikeDetector(g.spike_factor) if g.spike_factor else None
        self.memory = MemoryMonitor(
            self.device, warn_rss_gb=mem.warn_rss_gb, warn_cuda_fraction=mem.warn_cuda_fraction, probe=memory_probe
        )
        self.leaks = LeakDetector(
            every_steps=mem.leak_every_steps, warmup_steps=mem.leak_warmup_steps, window=mem.leak_window,
            max_overhead=mem.leak_max_overhead, device=self.device, probe=memory_probe,
        ) if mem.leak_check else None
        self.input_bound = InputBoundDetector()
        self._best_unsaved = False
        es = cfg.train.early_stop
        self.stopper = EarlyStopping(es.monitor or ck.monitor, es.mode or ck.mode, es.patience,
                                     es.min_delta) if es.patience else None
        self.oom_hook = oom_hook
        self.resume, self.overwrite, self.show_progress = resume, overwrite, progress
        self.allow_config_change = allow_config_change
        # Progress counters: all a resumed run needs to continue with the very next batch.
        self.step = self.epoch = self.batch_in_epoch = self.samples = 0
        self.val_metrics: dict[str, float] = {}
        self.validated_at = self.saved_at = -1
        self.micro_batch_size: int | None = None  # shrunk after an out-of-memory error
        self.diagnosis: dict[str, Any] | None = None  # of the first non-finite step
        # The two latest good states: a rollback returns to the older one, since by the time a
        # step goes non-finite the newer one may already be on the diverging path.
        self.snapshots: list[Snapshot] = []
        self.incidents = IncidentLog(None)
        self._loggers = RunLoggers([])
        self._previous: PreviousRun | None = None  # the run --overwrite set aside, until this one is safe
        self._ahead: Lookahead | None = None  # the epoch's groups, one read ahead
        self._shown_bad: set[str] = set()  # bad samples already printed: once per run, every one in incidents

    def _build(self, cfg: KeelConfig, model: torch.nn.Module | None, train_data: Any, val_data: Any,
               loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> None:
        """Seed, data, model, loss, optimizer, schedule — in this order (a hand loop that follows it
        draws the same random numbers)."""
        seed_everything(cfg.seed, cfg.deterministic)
        self.data = build_loaders(cfg.data, batch_size=cfg.train.batch_size, seed=cfg.seed, device=self.device,
                                  train_data=train_data, val_data=val_data, rank=self.rank.rank,
                                  world_size=self.rank.world_size)
        self.train_loader, self.val_loader = self.data.train, self.data.val
        self.model = (model if model is not None else build_model(cfg.model)).to(self.device)
        if cfg.model.init_from:
            self._init_weights(cfg.model.init_from, cfg.model.init_strict)
        wrapped = self.job.wrap(self.model, precision=cfg.precision, batch_size=cfg.train.batch_size,
                                accumulate=cfg.train.accumulate)
        self.job.seed_rank(cfg.seed)
        c = cfg.compile
        self.forward_model = CompiledOrEager(wrapped, c.backend, mode=c.mode, fullgraph=c.fullgraph, dynamic=c.dynamic,
                                             report=self._compile_event) if c.enabled else wrapped
        self.objective = build_objective(cfg.loss, loss_fn, self.model)
        self.val_scores = MetricSet.from_config(cfg.metrics, self.device)
        self.train_scores = MetricSet.from_config(cfg.metrics, self.device, on="train")
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        ema = cfg.train.ema
        self.ema = WeightAverage(self.model, ema.decay, ema.start_step) if ema.decay else None
        self.optimizer = build_optimizer(cfg.optim, self.params)
        # The schedule's length: exact when no sample is bad (every epoch's plan is known); the
        # loop itself ends with the data, and the last step's learning rate is the floor.
        self.total_steps = total_steps(
            self.train_loader.num_batches, cfg.train.accumulate, cfg.train.max_epochs, cfg.train.max_steps
        )
        self.scheduler = build_scheduler(
            self.optimizer, warmup_steps=cfg.schedule.warmup_steps, total_steps=self.total_steps,
            decay=cfg.schedule.decay, min_lr=cfg.schedule.min_lr,
        )
        self.run_dir = Path(cfg.out_dir) / cfg.name

    def fit(self) -> dict[str, Any]:
        """Train to the configured limit; return the summary that is also written to ``summary.json``.

        ``status`` is ``completed``, ``preempted`` (SIGTERM/SIGINT: checkpoint written, see
        ``signal``), ``failed`` (with ``error``) or ``interrupted`` (a second Ctrl-C).
        """
        try:
            return self._fit()
        finally:
            self.job.close()

    def _fit(self) -> dict[str, Any]:
        cfg, is_main = self.config, self.rank.is_main
        # Every rank verifies the same checkpoint; rank 0 reports what it skipped.
        warn = Progress(self.total_steps, enabled=False).warn if is_main else (lambda message: None)
        found = find_checkpoint(self.store, self.resume, warn) if self.resume else None
        changes = check_resume_config(found.manifest, to_dict(cfg), allow=self.allow_config_change,
                                      checkpoint=found.path) if found is not None else []
        self._progress = Progress(self.total_steps, enabled=self.show_progress and is_main,
                                  initial=found.step if found is not None else 0)
        if is_main:
            _, self._previous = prepare_run_dir(cfg.out_dir, cfg.name, overwrite=self.overwrite,
                                                resume=self.resume is not None)
            write_text_atomic(self.run_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
            for name in ("metrics.jsonl", "incidents.jsonl"):
                truncate_metrics(self.run_dir / name, found.step if found else 0)
        self._metrics = MetricsWriter(self.run_dir / "metrics.jsonl") if is_main else None
        self._loggers = RunLoggers.from_config(
            cfg.logging, self.run_dir, to_dict(cfg), yaml.safe_dump(to_dict(cfg), sort_keys=False),
            found.step if found else None) if is_main else RunLoggers([])
        self.incidents = IncidentLog(self.run_dir / "incidents.jsonl" if is_main else None)
        self._provenance = {**provenance(config_hash(cfg)), "config": to_dict(cfg)}
        self._start = time.perf_counter()
        if self.job.active:
            self._log({"kind": "dist", "step": 0, "world_size": self.rank.world_size, "strategy": self.job.strategy,
                       "backend": self.job.group.backend, "batch_per_rank": self.config.train.batch_size
                       // self.rank.world_size})
            if is_main:
                print(f"keel: {self.job.describe(self.config.train.batch_size)}", file=sys.stderr)
        if self.data.tuning is not None:
            self._log({"step": 0, **self.data.tuning.row()})
            self._progress.note(f"data.num_workers=auto: {self.data.tuning.num_workers} ({self.data.tuning.reason})")
        if found is not None:
            with self.job.watch("loading the checkpoint", found.step):
                self._restore(found)
            row = {"kind": "resume", "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                   "samples": self.samples, "checkpoint": str(found.path)}
            if is_main:  # always said, progress output or not
                self._progress.say("resumed: " + " ".join(f"{k} {v}" for k, v in row.items() if k != "kind"))
                for line in changes:
                    self._progress.say(line)
            self._log(row)
        summary: dict[str, Any] = {"status": "failed"}
        error: BaseException | None = None
        try:
            with StopSignals() as self._signals:
                self._train()
            if self.saver is not None:
                self.saver.wait()  # the final save is on disk before the run reports done
            if self._signals.requested:
                summary = {"status": "preempted", "signal": self._signals.name}
            elif self.stopper is not None and self.stopper.stop_reason:
                summary = {"status": "stopped_early", "reason": self.stopper.stop_reason,
                           "best_step": self.stopper.best_step, "best": self.stopper.best}
            else:
                summary = {"status": "completed"}
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
            summary = self._finish(summary)
            if self._settle_previous_run(summary["status"]) and error is not None:
                error.__notes__ = [*getattr(error, "__notes__", []),
                                   f"the previous run was put back in '{self.run_dir}'"]
        return summary

    @property
    def early_stop(self) -> dict[str, Any] | None:
        """The early-stopping state a checkpoint carries (None when it is off)."""
        return self.stopper.state_dict() if self.stopper else None

    @early_stop.setter
    def early_stop(self, state: dict[str, Any] | None) -> None:
        if self.stopper is not None and state is not None:
            self.stopper.load_state_dict(state)

    def _settle_previous_run(self, status: str) -> bool:
        """Discard the run ``--overwrite`` set aside once the new one is safe, else put it back
        (and return True)."""
        previous, self._previous = self._previous, None
        if previous is None:
            return False
        if status in ("completed", "preempted", "stopped_early"):
            previous.discard()
            return False
        previous.restore()
        return True

    def _train(self) -> None:
        train = self.config.train
        window_samples, window_start = 0, time.perf_counter()
        self._take_snapshot()
        if self.stopper is not None and self.stopper.stop_reason:
            return  # resumed from the checkpoint where it stopped early: nothing left to do
        # An epoch ends when its data does (on every rank together); only max_steps stops mid-epoch.
        while not self._is_at_max_steps() and (train.max_epochs is None or self.epoch < train.max_epochs):
            batches = TimedBatches(self.train_loader.epoch(self.epoch, start_batch=self.batch_in_epoch))
            self.input_bound.start()
            # One group is read ahead, so that the epoch's last step is known when it is taken.
            self._ahead = Lookahead(iter_groups(self.job.batches(batches, self._streaming), train.accumulate))
            for group, at_epoch_end in self._ahead:
                is_last = (at_epoch_end and self.epoch + 1 == train.max_epochs) or (
                    train.max_steps is not None and self.step + 1 == train.max_steps)
                if is_last and self.step + 1 < self.total_steps:
                    end_at_floor(self.scheduler, self.optimizer)  # fewer steps than planned (bad samples)
                is_log = (self.step + 1) % train.log_every == 0 or is_last
                lr = self.optimizer.param_groups[0]["lr"] if is_log else 0.0
                sync = self.job.sync
                if sync is not None:  # agreed in the step's all-gather: no collective of their own
                    sync.flags = [self._signals.requested is not None, self._is_save_due(False),
                                  bool(self.train_loader.new_bad)]
                with self.job.watch("the training step (forward, backward, gradient sync)", self.step + 1):
                    result = self._step(group)
                self.job.first_step_done()
                self.step += 1
                self.batch_in_epoch += len(group)
                self.samples += result.num_samples
                window_samples += result.num_samples
                if self.ema is not None and result.status == "ok":  # a skipped step is not averaged in
                    self.ema.update(self.step)
                self._progress.advance(1)
                if sync is not None:
                    stop, due, any_bad = sync.agreed
                else:
                    stop, due = any_rank_flags([self._signals.requested is not None, self._is_save_due(False)],
                                               self.device)
                    any_bad = bool(self.train_loader.new_bad)
                self._protect(result, group, batches.take(), any_bad)
                if is_log:
                    loss, grad_norm = result.loss_value, result.grad_norm_value
                    if loss is None:  # the guard is off: read them now (host sync, log steps only)
                        loss, grad_norm = result.loss.item(), result.grad_norm.item()
                    now = time.perf_counter()
                    metrics = {k: v.item() for k, v in (result.metrics or {}).items()}  # host sync, log steps only
                    if self.train_scores is not None:  # every rank, at the same steps: torchmetrics syncs here
                        metrics.update(self.train_scores.compute())
                    self._log({
                        "kind": "train", "step": self.step, "epoch": self.epoch, "loss": loss, "lr": lr,
                        "grad_norm": grad_norm, "samples": self.samples,
                        "samples_per_s": window_samples / max(now - window_start, 1e-9), **metrics,
                    })
                    window_samples, window_start = 0, time.perf_counter()
                if train.val_every and self.step % train.val_every == 0:
                    self._validate()
                    if self._is_stopping_early(at_epoch_end=at_epoch_end):
                        return
                if stop or ((due or self._is_every_steps()) and not at_epoch_end):
                    self._save()  # at an epoch's last batch the epoch-end save decides instead
                if stop:
                    return
                if self._is_at_max_steps() and not at_epoch_end:
                    break  # mid-epoch: the group read ahead is not trained on, nor counted as read
            else:
                self._ahead = None
                if not train.val_every:
                    self._validate()
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                if not train.val_every and self._is_stopping_early(at_epoch_end=True):
                    return
                with self.job.watch("the agreement on saving", self.step):
                    due = any_rank(self._is_save_due(True), self.device)
                if due or self._is_every_steps() or self._best_unsaved:
                    self._save()
            self._ahead = None
        if self.validated_at != self.step:
            self._validate()
        if self.config.guard.enabled and not all(bool(torch.isfinite(_local(p)).all()) for p in self.params):
            raise TrainingDiverged("the weights are non-finite at the end of training; see incidents.jsonl")
        self._save()

    def _is_at_max_steps(self) -> bool:
        return self.config.train.max_steps is not None and self.step >= self.config.train.max_steps

    def _step(self, group: list[Any]) -> Any:
        """``train_step`` with the run's settings; a label out of range is named with its sample."""
        train = self.config.train
        try:
            return train_step(
                self.forward_model, self.optimizer, group, self.objective, params=self.params,
                precision=self.precision, device=self.device,
                clip_grad_norm_max=train.clip_grad_norm, scheduler=self.scheduler,
                check_finite=self.config.guard.enabled, split_on_oom=self.config.oom.auto_split,
                micro_batch_size=self.micro_batch_size, before_forward=self.oom_hook, sync=self.job.sync,
                on_outputs=self.train_scores.update if self.train_scores is not None else None,
            )
        except LabelOutOfRange as exc:
            origin = self.train_loader.origin(group[exc.micro_batch], exc.sample)
            exc.add_note(f"step {self.step + 1}, micro-batch {exc.micro_batch}: {origin or 'origin unknown'}")
            raise

    def _protect(self, result: Any, group: list[Any], wait_s: float, any_bad: bool) -> None:
        """Act on what the step and the data reported: bad samples, OOM splits, non-finite steps,
        spikes, memory, leaks, waiting for input. ``any_bad``: some rank met bad samples (agreed)."""
        loader = self.train_loader
        if any_bad:
            self._bad_samples(loader)
        waiting = self.input_bound.observe(wait_s)
        if waiting is not None:
            self._incident("input_bound", f"input-bound: {waiting['wait_fraction']:.0%} of the time went to waiting "
                           f"for the next batch ({waiting['wait_s_per_step'] * 1e3:.1f} ms a step, the step itself "
                           f"{waiting['compute_s_per_step'] * 1e3:.1f} ms); raise data.num_workers (now "
                           f"{loader.num_workers}), make __getitem__ cheaper, or cache the decoded data", **waiting)
        if result.num_oom_splits:
            self._incident("oom_split", f"out of memory: the step was redone in micro-batches of "
                           f"{result.micro_batch_size} samples, kept for the following steps",
                           micro_batch_size=result.micro_batch_size, splits=result.num_oom_splits)
        self.micro_batch_size = result.micro_batch_size  # under torchrun the smallest that fit on any rank
        if result.status == "nonfinite":
            self._on_nonfinite(group)
        else:
            self.guard.observe(True)
            every = self.config.guard.snapshot_every
            if result.status == "ok" and every and self.step % every == 0:
                self._take_snapshot()
        if self.spikes is not None and result.loss_value is not None:
            average = self.spikes.observe(result.loss_value)
            if average is not None:
                self._incident("spike", f"loss {result.loss_value:.4g} is above {self.spikes.factor} x its "
                               f"running average {average:.4g}", loss=result.loss_value, average=average)
        every = self.config.memory.every_steps
        if every and self.step % every == 0:
            stats, warnings = self.memory.sample()
            self._log({"kind": "memory", "step": self.step, **stats.row()})
            for warning in warnings:
                self._incident("memory", warning, **stats.row())
        finding = self.leaks.observe(self.step) if self.leaks is not None else None
        if finding is not None:
            top = finding["top_groups"][0] if finding["top_groups"] else None
            what = f"; most added: {top['added']} tensors of shape {top['shape']} {top['dtype']}" + (
                " holding autograd graphs" if top["holds_graph"] else "") if top else ""
            self._incident("leak", f"memory grows every census ({finding['signal']}): "
                           f"{finding['graph_nodes_per_step']:.1f} graph nodes and {finding['tensors_per_step']:.2f} "
                           f"tensors per step{what} — a tensor kept across steps (total_loss += loss?)", **finding)

    def _bad_samples(self, loader: Any) -> None:
        """Every rank's new bad samples become incidents (on rank 0's file); each is printed once
        per run. With several ranks the counts are shared first, so that every rank decides the
        same on ``data.max_bad_fraction`` (one gather, only at steps where some rank met one)."""
        mine = list(loader.new_bad)
        loader.new_bad.clear()
        everyone = self.job.all_gather_object(mine) if self.job.active else [mine]
        for rank, bad in enumerate(everyone):
            if rank != self.rank.rank:
                loader.bad.add_others(bad)
            for where, error in bad:
                shown = where in self._shown_bad
                self._shown_bad.add(where)
                self._incident("bad_sample", f"skipped a bad sample: {where}: {error}", quiet=shown, where=where,
                               error=error, rank=rank)
        loader.bad.check()

    def _on_nonfinite(self, group: list[Any]) -> None:
        diagnosis = None
        if self.config.guard.diagnose and self.diagnosis is None:  # the first non-finite step only
            diagnosis = self.diagnosis = diagnose_nonfinite(
                self.model, group, self.objective, precision=self.precision, device=self.device
            )
        action = self.guard.observe(False, can_roll_back=bool(self.snapshots))
        self._incident("nonfinite", f"non-finite loss or gradients: step skipped ({action.value})"
                       + (f"; {diagnosis['summary']}" if diagnosis else ""), action=action.value, diagnosis=diagnosis)
        if action is Action.ROLLBACK:
            del self.snapshots[1:]
            good = self.snapshots[0]
            good.restore(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                         scaler=self.precision.scaler)
            apply_lr_scale(self.scheduler, self.optimizer, self.guard.lr_scale)
            self._incident("rollback", f"rolled back to the state of step {good.step}; learning rate "
                           f"scaled to {self.guard.lr_scale:g} x", to_step=good.step, lr_scale=self.guard.lr_scale)
        elif action is Action.FAIL:
            first = self.diagnosis["summary"] if self.diagnosis else "no diagnosis"
            raise TrainingDiverged(
                f"training diverged: {self.guard.num_skipped} non-finite steps, {self.guard.num_rollbacks} "
                f"rollbacks; {first}. Lower optim.lr, check the data and incidents.jsonl", self.diagnosis,
            )

    def _take_snapshot(self) -> None:
        if self.config.guard.snapshot_every:
            taken = Snapshot.take(self.step, model=self.model, optimizer=self.optimizer,
                                  scheduler=self.scheduler, scaler=self.precision.scaler)
            self.snapshots = [*self.snapshots, taken][-2:]

    def _incident(self, kind: str, message: str, quiet: bool = False, **details: Any) -> None:
        """Record an incident (rank 0 writes it); ``quiet``: in the files, not printed again."""
        row = self.incidents.record(kind, self.step, message, **details)
        if self.rank.is_main:
            if not quiet:
                self._progress.warn(f"step {row['step']}: {message}")
            self._loggers.log_incident(row)

    def _validate(self) -> None:
        self.validated_at = self.step
        if self.val_loader is None:
            return
        with self.job.watch("validation", self.step):
            self.val_metrics = evaluate(
                self.ema.module if self.ema is not None else self.job.evaluation_model(self.model), self.job.batches(self.val_loader.epoch(0), self._streaming),
                self.objective, device=self.device, precision=self.precision, across_ranks=True,
                metrics=self.val_scores,
            )
            self._bad_samples(self.val_loader)
        self._log({"kind": "val", "step": self.step, "epoch": self.epoch, **self.val_metrics})

    def _compile_event(self, kind: str, message: str, details: dict[str, Any]) -> None:
        """A graph break or a fall-back to eager is an incident; the compile time a metrics row."""
        if "compile_s" in details:
            self._log({"kind": "compile", "step": self.step, **details})
            self._progress.note(message)
        else:
            self._incident(kind, message, **details)

    def _is_stopping_early(self, at_epoch_end: bool) -> bool:
        """After a validation: save when the monitored metric improved (so the best state is on
        disk), and when early stopping says stop (the run ends there). A mid-epoch validation at
        the epoch's last batch leaves the save to the epoch end, like every other save."""
        self._best_unsaved = False
        if self.stopper is None or self.val_loader is None:
            return False
        improved = self.stopper.observe(self.val_metrics, self.step)
        if self.stopper.stop_reason or (improved and not (at_epoch_end and self.config.train.val_every)):
            self._save()
        elif improved:
            self._best_unsaved = True
        if self.stopper.stop_reason and self.rank.is_main:
            self._progress.note(f"stopping early at step {self.step}: {self.stopper.stop_reason}")
        return self.stopper.stop_reason is not None

    def _is_every_steps(self) -> bool:
        every = self.config.checkpoint.every_steps
        return bool(every) and self.step % every == 0

    def _is_save_due(self, at_epoch_end: bool) -> bool:
        # Rank 0's clock decides; the other ranks learn it in the agreement that follows.
        return self.rank.is_main and self.config.checkpoint.enabled and self.cadence.is_due(at_epoch_end)

    def _save(self) -> None:
        """Checkpoint the current state, once per step at most. Every rank takes part (its RNG and
        data position are saved with it); rank 0 writes, except each rank's shards under FSDP."""
        if not self.config.checkpoint.enabled or self.saved_at == self.step:
            return
        self.saved_at = self.step
        with self.job.watch("saving a checkpoint", self.step):
            # Under torchrun every rank's RNG and data position; in one process capture_training_state's suffice.
            held = (self._ahead.held or []) if self._ahead is not None else []  # read ahead, not trained on
            ranks = self.job.gather({"rng": capture_rng() if self.job.active else None,
                                     "data": self.train_loader.state_dict(unconsumed=held)})
            if self.rank.is_main:
                assert ranks is not None
                progress = {name: getattr(self, name) for name in PROGRESS}
                progress["data"] = ranks[0]["data"] if len(ranks) == 1 else [r["data"] for r in ranks]
                protections = {"guard": self.guard.state_dict(), "incidents": dict(self.incidents.counts),
                               "spikes": self.spikes.state_dict() if self.spikes else None,
                               "shown_bad": sorted(self._shown_bad)[:MAX_SHOWN_BAD]}
                state = capture_training_state(self.model, self.optimizer, self.scheduler, self.precision.scaler,
                                               progress, protections, weights=not self.job.sharded)
                if len(ranks) > 1:
                    state["ranks"] = {"rng": [r["rng"] for r in ranks]}
                if self.ema is not None:
                    state["ema"] = self.ema.state_dict()
            kwargs = {"step": self.step, "epoch": self.epoch, "metrics": self.val_metrics, "meta": self._provenance}
            start = time.perf_counter()
            if self.job.sharded:
                save_sharded(self.store, state if self.rank.is_main else {}, self.model, self.optimizer,
                             hook=self.store.hook, **kwargs)
            elif not self.rank.is_main:
                return
            elif self.saver is not None:
                self.saver.save(state, **kwargs)
                if self._previous is not None:
                    self.saver.wait()  # the first checkpoint must be on disk before the previous run goes
            else:
                self.store.save(state, **kwargs)
        self.cadence.saved(time.perf_counter() - start)
        if self._previous is not None:
            self._previous.discard()
            self._previous = None

    def _restore(self, found: Checkpoint) -> None:
        if (found.shards is not None) != self.job.sharded:
            written = "dist.strategy=fsdp" if found.shards is not None else "full weights (no FSDP)"
            raise CheckpointError(
                f"checkpoint '{found.path}' was written with {written}, this run uses dist.strategy="
                f"{self.config.dist.strategy}: resume with the strategy it was written with (on any number of "
                "ranks), or start from its weights with model.init_from")
        if found.shards is not None:
            load_sharded(found, self.model, self.optimizer)
        progress = restore_training_state(found.state, self.model, self.optimizer, self.scheduler, self.precision.scaler)
        if self.ema is not None and found.state.get("ema") is not None:
            self.ema.load_state_dict(found.state["ema"])  # else the average starts afresh from these weights
        for name in PROGRESS:
            if name in progress or name != "early_stop":  # checkpoints from before early stopping lack it
                setattr(self, name, progress[name])
        per_rank_rng = (found.state.get("ranks") or {}).get("rng") or []
        if len(per_rank_rng) == self.rank.world_size > 1:
            restore_rng(per_rank_rng[self.rank.rank])  # dropout continues exactly on every rank
        elif self.rank.world_size > 1 or per_rank_rng:
            self.job.seed_rank(self.config.seed + self.step)
            written = max(1, len(per_rank_rng))
            self._progress.warn(f"the checkpoint was written by {written} rank{'s' * (written > 1)}, this run has "
                                f"{self.rank.world_size}: each rank's random stream (dropout) starts afresh")
        if progress.get("data"):
            self.train_loader.load_state_dict(progress["data"])
        protections = found.state.get("protections") or {}
        self.guard.load_state_dict(protections.get("guard", {}))
        self.incidents.counts.update(protections.get("incidents", {}))
        self._shown_bad.update(protections.get("shown_bad", []))
        if self.spikes is not None and protections.get("spikes"):
            self.spikes.load_state_dict(protections["spikes"])

    @property
    def _streaming(self) -> bool:
        """Streamed data: ranks may hold different numbers of batches (kept in step by ``DataParallel``)."""
        return isinstance(self.train_loader, StreamLoader)

    def _init_weights(self, path: str, strict: bool) -> None:
        skipped = load_model_weights(self.model, load_weights(path), strict=strict, source=f"weights in '{path}'")
        if skipped:
            print(f"keel: warning: model.init_from '{path}': not loaded: {', '.join(skipped)}", file=sys.stderr)

    def _log(self, row: dict[str, Any]) -> None:
        row["wall_s"] = round(time.perf_counter() - self._start, 4)
        if self._metrics is not None:
            self._metrics.write(row)
        self._loggers.log(row)
        self._progress.log(row)

    def _finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        if self.saver is not None:
            self.saver.join()  # a save in flight is a complete state: let it land
        self._progress.close()
        line = self.incidents.summary_line({"bad_sample": len(self._shown_bad)})
        if line and self.rank.is_main:
            print(f"keel: {line} (details: {self.run_dir / 'incidents.jsonl'})", file=sys.stderr)
        summary = {
            **summary, **self.val_metrics,
            "incidents": dict(self.incidents.counts),
            "steps": self.step, "epochs": self.epoch, "samples": self.samples,
            "wall_s": round(time.perf_counter() - self._start, 3), "run_dir": str(self.run_dir),
        }
        self._loggers.close()
        if self._metrics is not None:
            self._metrics.close()
            write_json_atomic(self.run_dir / "summary.json", summary)
        return summary


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP parameter (a DTensor), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
