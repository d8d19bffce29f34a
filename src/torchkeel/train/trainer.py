"""The Trainer: build, then loop — step, protect, log, validate, save, stop.

The order of a training step is in ``torchkeel.train.step.train_step``; the components own the
rest: ``RunCounters`` (where the run stands), ``RunFiles`` (the run directory, rank 0),
``RunCheckpoints`` (save and restore, and when to save), ``LoopCadence`` (when to log, validate
and end), ``Protections`` (what acts after a step). This file composes them into the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torchkeel.checkpoint import Checkpoint
from torchkeel.config.load import config_hash, to_dict
from torchkeel.config.schema import KeelConfig
from torchkeel.distributed import RankInfo
from torchkeel.distributed.job import TrainingJob
from torchkeel.errors import TrainingDiverged
from torchkeel.provenance import provenance
from torchkeel.train.accumulate import Lookahead, iter_groups
from torchkeel.train.build import build_training, resolve_device, step_settings
from torchkeel.train.cadence import LoopCadence
from torchkeel.train.checkpointing import ResumeChanges, RunCheckpoints, RunState
from torchkeel.train.clipping import ClipRate
from torchkeel.train.counters import Agreed, RunCounters, TrainingParts
from torchkeel.train.early_stop import EarlyStopping
from torchkeel.train.hooks import TrainerHooks
from torchkeel.train.objective import LabelOutOfRange
from torchkeel.train.optim import describe_groups
from torchkeel.train.precision import make_precision
from torchkeel.train.preempt import StopSignals
from torchkeel.train.protect import BadSampleReport, Protections
from torchkeel.train.rundir import RunFiles
from torchkeel.train.runlog import Progress, Throughput, train_row
from torchkeel.train.schedule import add_train_loss, end_at_floor, epoch_ended, validated
from torchkeel.train.step import StepResult, train_step
from torchkeel.train.validate import evaluate


class Trainer:
    """Trains the model a ``KeelConfig`` describes, with every protection on.

    Objects passed in (``model``, ``train_data``/``val_data`` — map-style datasets or streaming
    sources —, ``loss_fn``) take the place of the config's import paths. Build order — seed,
    data, model, loss, optimizer — is fixed, so a hand-written loop that follows it draws the
    same random numbers. ``resume`` is ``"auto"`` (the newest valid checkpoint of the run, or a
    fresh start) or a checkpoint directory; a config that differs from the checkpoint's in what
    the run computes (data, model, batch, seed…) is refused unless ``allow_config_change``, and
    data files changed since the checkpoint (``torchkeel.data.inputs``) unless ``allow_data_change``.

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
        allow_data_change: bool = False,
        overwrite: bool = False,
        progress: bool = True,
        hooks: TrainerHooks | None = None,
    ) -> None:
        self.config, self.rank = (cfg := config.validate()), RankInfo.from_env()
        hooks = hooks or TrainerHooks()
        self.device = resolve_device(cfg.device, self.rank)
        self.precision = make_precision(cfg.precision, self.device)
        self.job = TrainingJob(cfg.dist, self.rank, self.device)  # joins the job under torchrun
        self.counters, self.run_dir = RunCounters(), Path(cfg.out_dir) / cfg.name
        self.files = RunFiles(self.run_dir, is_main=self.rank.is_main)
        try:
            t = build_training(cfg, self.job, model, train_data, val_data, loss_fn, report=self._compile_event)
        except BaseException:
            self.job.close()
            raise
        self.data, self.train_loader, self.val_loader = t.data, t.data.train, t.data.val
        self.model, self.forward_model, self.objective, self.params = t.model, t.forward_model, t.objective, t.params
        self.val_scores, self.train_scores, self.ema, self.profiler = t.val_scores, t.train_scores, t.ema, t.profiler
        self.optimizer, self.scheduler, self.total_steps = t.optimizer, t.scheduler, t.total_steps
        self.param_groups = t.param_groups
        self.carry = t.carry
        self.steps = step_settings(cfg, t, self.precision, self.job, agree=self._agree, hooks=hooks)
        self.cadence, self.clips = LoopCadence(cfg.train, cfg.val), ClipRate(cfg.train.clip_grad_norm)
        self.parts = TrainingParts(self.model, self.optimizer, self.scheduler, self.precision.scaler, self.ema)
        self.checkpoints = RunCheckpoints(cfg.checkpoint, self.run_dir / "checkpoints", self.job, hook=hooks.checkpoint)
        self.store = self.checkpoints.store
        workers = self.train_loader.num_workers
        self.protections = Protections.from_config(
            cfg, self.parts, t.objective, self.precision, self.device, workers, hooks.memory
        )
        self.guard, self.stopper = self.protections.guard, EarlyStopping.from_config(cfg)
        self.bad_samples = BadSampleReport(self.job)
        self.resume, self.overwrite, self.show_progress = resume, overwrite, progress
        self.allow = ResumeChanges(config=allow_config_change, data=allow_data_change)
        held = (self.counters, self.protections, self.bad_samples, self.files.incidents, self.stopper)
        self.state = RunState(*held, self.train_loader, self.carry)
        self._ahead = Lookahead(())  # the epoch's groups, one read ahead
        self._best_unsaved = False

    @property
    def step(self) -> int:
        return self.counters.step

    def fit(self) -> dict[str, Any]:
        """Train to the configured limit; return the summary that is also written to ``summary.json``.

        ``status`` is ``completed``, ``preempted`` (SIGTERM/SIGINT: checkpoint written, see
        ``signal``), ``failed`` (with ``error``) or ``interrupted`` (a second Ctrl-C).
        """
        try:
            return self._fit()
        finally:
            self.profiler.close()
            self.job.close()

    def _fit(self) -> dict[str, Any]:
        cfg, is_main, plain = self.config, self.rank.is_main, to_dict(self.config)
        # Every rank verifies the same checkpoint; rank 0 reports what it skipped.
        warn = self.files.console.warn if is_main else None
        found, changes, inputs = self.checkpoints.resumable(self.resume, plain, self.data.sources, self.allow, warn)
        start = found.step if found is not None else None
        self.files.console = Progress(self.total_steps, enabled=self.show_progress and is_main, initial=start or 0)
        resumed = self.resume is not None
        self.files.open(plain, resume=resumed, resume_step=start, overwrite=self.overwrite, logging=cfg.logging)
        meta = {**provenance(config_hash(cfg)), "config": plain, "inputs": inputs}
        self.checkpoints.bind(self.parts, self.state, self.files, read_ahead=lambda: self._ahead.read_ahead, meta=meta)
        if self.job.active:
            self.files.log({"kind": "dist", "step": 0, **self.job.row(cfg.train.batch_size)})
            self.files.say(self.job.describe(cfg.train.batch_size))
            for warning in self.job.warnings(cfg.train.batch_size) if is_main else []:
                self.files.console.warn(warning)
        self.files.data_ready(self.data.tuning, [] if found is not None else self.data.empty_files)
        if self.carry is not None and cfg.oom.auto_split:
            self.files.note("train.carry: oom.auto_split is off (a split batch would split the carried state's rows)")
        self._report_param_groups(logged=found is not None)
        if found is not None:
            self._restore(found, changes)
        with self.files.ending(self._totals, lambda: {"bad_sample": len(self.bad_samples.shown)}) as summary:
            with StopSignals() as self._signals:
                self._train()
            self.checkpoints.wait()  # the final save is on disk before the run reports done
            if self._signals.requested:
                summary.update(status="preempted", signal=self._signals.name)
            elif self.stopper is not None and self.stopper.stop_reason:
                summary.update(status="stopped_early", **self.stopper.summary())
            else:
                summary.update(status="completed")
        return self.files.summary

    def _totals(self) -> dict[str, Any]:
        """The summary's figures, once a save in flight has landed (it is a complete state)."""
        self.checkpoints.join()
        return {**self.counters.totals(), **self.files.totals()}

    def _train(self) -> None:
        """Epochs until a limit, a stop signal or early stopping; then a last validation and save."""
        c = self.counters
        self._throughput = Throughput(c)
        self.protections.take_snapshot(c.step)
        if self.cadence.validates_at_start(c.step):
            self._validate()  # the untrained model, at step 0 (val.at_start)
        if self.stopper is not None and self.stopper.stop_reason:
            return  # resumed from the checkpoint where it stopped early: nothing left to do
        # An epoch ends when its data does (on every rank together); only max_steps stops mid-epoch.
        while self.cadence.wants_epoch(c.step, c.epoch):
            if self._train_epoch():
                return
        if c.validated_at != c.step:
            self._validate()
        if self.config.guard.enabled and not all(bool(torch.isfinite(_local(p)).all()) for p in self.params):
            raise TrainingDiverged("the weights are non-finite at the end of training; see incidents.jsonl")
        self.checkpoints.save_now()

    def _train_epoch(self) -> bool:
        """The current epoch from where the run stands; True when the run ends in it."""
        c = self.counters
        if self.carry is not None and c.batch_in_epoch == 0:  # mid-epoch, a resume continues the saved state
            self.carry.start_epoch()
        batches = self.data.checked(self.train_loader.epoch(c.epoch, start_batch=c.batch_in_epoch))
        self.protections.input_bound.start()
        # One group is read ahead, so that the epoch's last step is known when it is taken.
        groups = iter_groups(self.job.batches(batches, self.train_loader.streaming), self.config.train.accumulate)
        self._ahead = Lookahead(groups, lambda: self.train_loader.bad.handed)
        for group, last_of_epoch in self._ahead:
            plan = self.cadence.plan(c.step + 1, c.epoch, last_of_epoch)
            if plan.is_last and c.step + 1 < self.total_steps:
                end_at_floor(self.scheduler, self.optimizer)  # fewer steps than planned (bad samples)
            lr = self.optimizer.param_groups[0]["lr"] if plan.log else 0.0
            result = self._step(group)
            agreed: Agreed = result.agreed
            self._after_step(result, group, agreed)
            if plan.log:
                rates = self._throughput.rates(c)
                self.files.log(train_row(result, c, lr, rates, self.train_scores, self.clips.window_frac()))
            self._say_clipping(plan.is_last)
            if plan.validate:
                self._validate()
                if self._after_validation(at_epoch_end=last_of_epoch):
                    return True
            if agreed.stop:
                self._signals.stop_agreed()  # another rank's signal: this rank ends preempted too
                self.checkpoints.save_now()
                return True
            self.checkpoints.maybe_save(c.step, last_of_epoch=last_of_epoch, due=agreed.save_due)
            if plan.at_max_steps and not last_of_epoch:
                return False  # mid-epoch: the group read ahead is not trained on, nor counted as read
        return self._end_epoch()

    def _after_step(self, result: StepResult, group: list[Any], agreed: Agreed) -> None:
        """Count the step, and record what the bad-sample report and the protections found."""
        c = self.counters
        c.step, c.batch_in_epoch = c.step + 1, c.batch_in_epoch + len(group)
        c.samples, c.tokens = c.samples + result.num_samples, c.tokens + result.num_tokens
        c.micro_batch_size = result.micro_batch_size  # under torchrun the smallest that fit on any rank
        if self.ema is not None and result.status == "ok":  # a skipped step is not averaged in
            self.ema.update(c.step)
        if result.status == "ok":
            add_train_loss(self.scheduler, result.loss)  # schedule.monitor: train_loss
        norm = result.grad_norm if result.grad_norm_value is None else result.grad_norm_value
        self.clips.add(c.step, norm, applied=result.status == "ok")
        self.files.console.advance(1)
        if agreed.bad_samples:
            self.files.record(c.step, self.bad_samples.collect(self.train_loader, self._ahead.read_ahead))
        found = self.protections.after_step(result, group, c.step, self._ahead.take_wait())
        if self.carry is not None and result.status == "nonfinite":
            self.carry.reset_train()  # the skipped step's state may be non-finite too, and its diagnosis replayed it
        if found.incidents or found.rows or found.error:  # most steps find nothing
            self.files.record(c.step, found)

    def _end_epoch(self) -> bool:
        """The epoch's data ended: validate (without ``val.every_steps``), count it, save as
        the cadence says; True when early stopping ends the run."""
        c = self.counters
        self._ahead = Lookahead(())
        if self.cadence.validates_at_epoch_end:
            self._validate()
        c.epoch, c.batch_in_epoch = c.epoch + 1, 0
        epoch_ended(self.scheduler)  # a schedule.target with interval: epoch
        if self.cadence.validates_at_epoch_end and self._after_validation(at_epoch_end=True):
            return True
        self.checkpoints.at_epoch_end(c.step, wanted=self._best_unsaved)
        return False

    def _step(self, group: list[Any]) -> StepResult:
        """``train_step`` with the run's settings; a label out of range is named with its sample."""
        step = self.counters.step + 1
        self.profiler.before_step(step)
        try:
            with self.job.watch_step(step):
                model, micro_batch_size = self.forward_model, self.counters.micro_batch_size
                return train_step(model, self.optimizer, group, self.objective, self.steps, micro_batch_size)
        except LabelOutOfRange as exc:
            origin = self.train_loader.origin(self._ahead.first + exc.micro_batch, exc.sample)
            exc.add_note(f"step {step}, micro-batch {exc.micro_batch}: {origin or 'origin unknown'}")
            raise

    def _agree(self) -> Agreed:
        """Agreed in the step's own all-gather: a stop signal, a save rank 0's clock wants, bad samples."""
        return Agreed(
            self._signals.requested is not None, self.checkpoints.is_due(False), self.train_loader.bad.has_new
        )

    def _validate(self) -> None:
        c = self.counters
        c.validated_at = c.step
        if self.val_loader is None:
            return
        if self.carry is not None:
            self.carry.start_eval()
        with self.job.watch("validation", c.step):
            model = self.ema.module if self.ema is not None else self.job.evaluation_model(self.model)
            c.val_metrics = evaluate(
                model,
                self.job.batches(self.val_loader.epoch(0), self.val_loader.streaming),
                self.objective,
                device=self.device,
                precision=self.precision,
                across_ranks=True,
                metrics=self.val_scores,
                max_batches=self.config.val.max_batches,
            )
            self.files.record(self.counters.step, self.bad_samples.collect(self.val_loader))
        self.files.log({"kind": "val", "step": c.step, "epoch": c.epoch, **c.val_metrics})
        validated(self.scheduler, c.val_metrics)  # a schedule.target with a monitor (ReduceLROnPlateau)

    def _say_clipping(self, is_last: bool) -> None:
        """Once, in the files and on the console: clipping rescaled most of the run's first steps."""
        warning = self.clips.early_warning(self.counters.step, is_last)
        if warning is not None:
            self.files.log(warning.row())
            if self.rank.is_main:
                self.files.console.warn(warning.message)

    def _report_param_groups(self, logged: bool) -> None:
        """The optimizer's groups, once: on the console when the config splits them, and as a
        ``param_groups`` row of ``metrics.jsonl`` (unless a resumed run ``logged`` it already)."""
        for line in describe_groups(self.param_groups):
            self.files.say(line)
        if not logged:
            self.files.log({"kind": "param_groups", "step": 0, "groups": self.param_groups})

    def _compile_event(self, kind: str, message: str, details: dict[str, Any]) -> None:
        self.files.compile_event(self.counters.step, kind, message, details)

    def _after_validation(self, at_epoch_end: bool) -> bool:
        """Save the best state and stop, as early stopping says; True: the run ends here."""
        self._best_unsaved = False
        if self.stopper is None or self.val_loader is None:
            return False
        # A mid-epoch validation at the epoch's last batch leaves the save to the epoch end.
        save, self._best_unsaved = self.stopper.after(
            self.counters.val_metrics,
            self.counters.step,
            defer=at_epoch_end and not self.cadence.validates_at_epoch_end,
        )
        if save:
            self.checkpoints.save_now()
        if self.stopper.stop_reason:
            self.files.note(f"stopping early at step {self.counters.step}: {self.stopper.stop_reason}")
        return self.stopper.stop_reason is not None

    def _restore(self, found: Checkpoint, changes: list[str]) -> None:
        with self.job.watch("loading the checkpoint", found.step):
            self.checkpoints.restore(found, self.parts, self.state, self.config.seed, warn=self.files.console.warn)
        row = {**self.counters.position(), "checkpoint": str(found.path)}
        for line in ["resumed: " + " ".join(f"{k} {v}" for k, v in row.items()), *changes]:
            self.files.say(line)  # always said, progress output or not
        self.files.log({"kind": "resume", **row})


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP parameter (a DTensor), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
