"""Learning-rate schedules: the built-in warmup then cosine, linear or constant decay by optimizer
step, or a scheduler of the user's (``schedule.target``) after the same warmup.

The built-in schedule, of 0-based optimizer step ``s``, peak ``lr``, ``W`` warmup steps, decay
end ``D`` (``decay_steps``; by default the run's last step ``T - 1``, or ``T`` in the
``transformers`` style)::

    s < W:   lr * (s + 1) / W          style torchkeel (the last warmup step reaches lr)
             lr * (s + 1) / (W + 1)    style nanogpt  (nanoGPT's get_lr)
             lr * s / W                style transformers (get_*_schedule_with_warmup)
    s >= W:  p = min((s - W) / max(D - W, 1), 1)
             cosine:   min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * p))
             linear:   lr - (lr - min_lr) * p
                       (transformers: min_lr + (lr - min_lr) * max(0, (D - s) / max(D - W, 1)))
             constant: lr

Who steps what: ``train_step`` calls ``scheduler.step()`` after each applied optimizer step; the
Trainer calls ``epoch_ended`` at each epoch's end and ``validated`` after each validation, which
step a ``TargetSchedule`` as its ``interval`` and ``monitor`` say (the built-in one ignores them).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from torchkeel.config.imports import build_target
from torchkeel.config.schema import ScheduleConfig
from torchkeel.errors import ConfigError

TRAIN_LOSS = "train_loss"
"""``schedule.monitor`` for the epoch's mean training loss (every other monitor is a validation metric)."""


def warmup_fraction(step: int, warmup_steps: int, style: str = "torchkeel") -> float:
    """The share of the peak rate warmup step ``step < warmup_steps`` uses, in ``style``'s formula."""
    if style == "nanogpt":
        return (step + 1) / (warmup_steps + 1)
    if style == "transformers":
        return step / warmup_steps
    return (step + 1) / warmup_steps


def lr_at(
    step: int,
    *,
    lr: float,
    warmup_steps: int,
    total_steps: int,
    decay: str = "cosine",
    min_lr: float = 0.0,
    style: str = "torchkeel",
    decay_steps: int | None = None,
) -> float:
    """Learning rate of optimizer step ``step`` (0-based), by the formula in this module's docstring.

    Example: nanoGPT's ``get_lr(it)`` with ``warmup_iters=W``, ``lr_decay_iters=D`` is
    ``lr_at(it, lr=learning_rate, min_lr=min_lr, warmup_steps=W, decay_steps=D, total_steps=T, style="nanogpt")``.
    """
    if step < warmup_steps:
        return lr * warmup_fraction(step, warmup_steps, style)
    if decay == "constant":
        return lr
    if decay_steps is not None:
        end = decay_steps
    else:  # transformers' schedules end one step past the last (num_training_steps)
        end = total_steps if style == "transformers" else total_steps - 1
    progress = min((step - warmup_steps) / max(end - warmup_steps, 1), 1.0)
    if decay == "linear" and style == "transformers":  # its order of operations: get_linear_schedule_with_warmup's bits
        return min_lr + (lr - min_lr) * max(0.0, (end - step) / max(end - warmup_steps, 1))
    if decay == "linear":
        return lr - (lr - min_lr) * progress
    if decay == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown decay {decay!r}; use cosine, linear or constant")


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    total_steps: int,
    decay: str = "cosine",
    min_lr: float = 0.0,
    style: str = "torchkeel",
    decay_steps: int | None = None,
    peak_lr: float | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` that follows ``lr_at`` for every param group, relative to its own initial lr.

    Call ``scheduler.step()`` once per optimizer step. ``min_lr`` is absolute for a group whose
    rate is ``peak_lr`` (``None``: the first group's); other groups keep the same ratio.
    """
    base_lr = peak_lr if peak_lr is not None else optimizer.param_groups[0]["lr"]
    factor = functools.partial(
        _factor,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        decay=decay,
        min_ratio=min_lr / base_lr,
        style=style,
        decay_steps=decay_steps,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _factor(step: int, *, min_ratio: float, **plan: Any) -> float:
    return lr_at(step, lr=1.0, min_lr=min_ratio, **plan)


class TargetSchedule:
    """A scheduler of the user's (``schedule.target``), after ``warmup_steps`` of warmup.

    During warmup each group's rate is the target's first rate times ``warmup_fraction``; from
    step ``warmup_steps`` on the target takes over at its own first rate, and only then counts
    what steps it: each optimizer step (``interval="step"``), each epoch's end (``"epoch"``),
    each validation with the value of ``monitor`` (``ReduceLROnPlateau``), or, with ``monitor``
    ``train_loss``, each epoch's end with the mean of its steps' training losses (as a script
    that steps its plateau on the epoch's mean batch loss; feed them with ``add_train_loss``). A
    validation before the first optimizer step does not step it. Its state (the target's, the steps taken) goes
    into checkpoints, so a resumed run continues exactly.

    Example (a hand loop)::

        schedule = TargetSchedule(optimizer, lambda o: StepLR(o, step_size=1, gamma=0.7), interval="epoch")
        for epoch in range(epochs):
            for batch in loader:
                ...; optimizer.step(); schedule.step()
            schedule.epoch_ended()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        make: Callable[[torch.optim.Optimizer], Any],
        *,
        warmup_steps: int = 0,
        style: str = "torchkeel",
        interval: str = "step",
        monitor: str | None = None,
    ) -> None:
        self.optimizer, self.warmup_steps, self.style = optimizer, warmup_steps, style
        self.interval, self.monitor = interval, monitor
        self.scheduler = make(optimizer)
        self.num_steps = 0
        """Applied optimizer steps so far."""
        self.lr_scale = 1.0
        self._target_lrs = [group["lr"] for group in optimizer.param_groups]
        self._loss_sum: torch.Tensor | float = 0.0  # monitor train_loss: this epoch's, on the device
        self._loss_count = 0
        self._warm()

    @property
    def is_warming_up(self) -> bool:
        return self.num_steps < self.warmup_steps

    def step(self) -> None:
        """After each applied optimizer step."""
        self.num_steps += 1
        if self.num_steps <= self.warmup_steps:
            self._warm()
        elif self.interval == "step" and self.monitor is None:
            self._step_target()

    def add_train_loss(self, loss: torch.Tensor) -> None:
        """An applied step's (detached) training loss, with ``monitor`` ``train_loss``: summed on
        its device, read once at the epoch's end."""
        if self.monitor == TRAIN_LOSS:
            self._loss_sum = self._loss_sum + loss.detach().float()
            self._loss_count += 1

    def epoch_ended(self) -> None:
        """At each epoch's end."""
        if self.monitor == TRAIN_LOSS:
            total, count = self._loss_sum, self._loss_count
            self._loss_sum, self._loss_count = 0.0, 0
            if count and not self.is_warming_up:
                self._step_target(float(total) / count)
        elif self.interval == "epoch" and self.monitor is None and not self.is_warming_up:
            self._step_target()

    def validated(self, metrics: Mapping[str, float]) -> None:
        """After each validation, with its metrics.

        Raises:
            ConfigError: ``monitor`` is not among ``metrics``.
        """
        if self.monitor in (None, TRAIN_LOSS) or self.is_warming_up or self.num_steps == 0:
            return
        if self.monitor not in metrics:
            raise ConfigError(
                f"schedule.monitor={self.monitor!r} is not a validation metric; this run logs "
                f"{', '.join(sorted(metrics)) or 'none'}"
            )
        self._step_target(float(metrics[self.monitor]))

    def _step_target(self, *value: float) -> None:
        if self.num_steps:
            # A resumed run's first epoch end can come before this process's first optimizer
            # step, and torch would warn of a step out of order: the steps before were taken.
            # Its own flag says so (no warnings.catch_warnings: that would reset the show-once
            # record of every other warning, which then repeats at each scheduler step).
            self.optimizer._opt_called = True  # type: ignore[attr-defined]
        self.scheduler.step(*value)

    def scale_lr(self, scale: float) -> None:
        """Rates ``scale`` × the target's, from now on (a rollback's back-off): the current rates
        and the target's base rates are multiplied by ``scale`` over the scale in force."""
        ratio, self.lr_scale = scale / self.lr_scale, scale
        self._target_lrs = [lr * ratio for lr in self._target_lrs]
        for group in self.optimizer.param_groups:
            group["lr"] *= ratio
        if hasattr(self.scheduler, "base_lrs"):
            self.scheduler.base_lrs = [lr * ratio for lr in self.scheduler.base_lrs]

    def _warm(self) -> None:
        """Warmup's rates for the step to come; at its end, the target's own first rates back."""
        if self.num_steps > self.warmup_steps:
            return
        share = warmup_fraction(self.num_steps, self.warmup_steps, self.style) if self.is_warming_up else 1.0
        for group, lr in zip(self.optimizer.param_groups, self._target_lrs):
            group["lr"] = lr * share

    def state_dict(self) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler.state_dict(),
            "num_steps": self.num_steps,
            "lr_scale": self.lr_scale,
            "target_lrs": list(self._target_lrs),
            "train_loss": [float(self._loss_sum), self._loss_count],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.num_steps, self.lr_scale = state["num_steps"], state["lr_scale"]
        self._target_lrs = list(state["target_lrs"])
        loss_sum, self._loss_count = state.get("train_loss", (0.0, 0))
        self._loss_sum = torch.tensor(loss_sum, dtype=torch.float32) if self._loss_count else 0.0


def build_schedule(
    cfg: ScheduleConfig,
    optimizer: torch.optim.Optimizer,
    *,
    total_steps: int,
    peak_lr: float | None,
    has_validation: bool = True,
) -> torch.optim.lr_scheduler.LambdaLR | TargetSchedule:
    """The run's schedule: the built-in one (a ``LambdaLR``), or ``schedule.target`` after warmup.

    Raises:
        ConfigError: the target is not a scheduler; a metric-stepped one without ``monitor``,
            ``monitor`` without validation data or with a scheduler that takes no metric.
    """
    if cfg.target is None:
        return build_scheduler(
            optimizer,
            warmup_steps=cfg.warmup_steps,
            total_steps=total_steps,
            decay=cfg.decay,
            min_lr=cfg.min_lr,
            style=cfg.style,
            decay_steps=cfg.decay_steps,
            peak_lr=peak_lr,
        )
    if cfg.monitor not in (None, TRAIN_LOSS) and not has_validation:
        raise ConfigError(
            f"schedule.monitor={cfg.monitor!r} is a validation metric, and this run has no validation data: give "
            "it some (a (train, val) pair from data.target, data.val for a streaming source, val_data= in "
            f"Python), or monitor {TRAIN_LOSS} (the epoch's mean training loss)"
        )
    schedule = TargetSchedule(
        optimizer,
        functools.partial(_make_target, cfg),
        warmup_steps=cfg.warmup_steps,
        style=cfg.style,
        interval=cfg.interval,
        monitor=cfg.monitor,
    )
    takes_metric = _steps_on_a_metric(schedule.scheduler)
    if takes_metric and cfg.monitor is None:
        raise ConfigError(
            f"schedule.target={cfg.target!r} steps on a metric: set schedule.monitor (e.g. val_loss), "
            "and schedule.mode if higher is better"
        )
    if cfg.monitor is not None and not takes_metric:
        raise ConfigError(
            f"schedule.target={cfg.target!r} takes no metric in step(); remove schedule.monitor "
            "(or use torch.optim.lr_scheduler:ReduceLROnPlateau)"
        )
    return schedule


def _make_target(cfg: ScheduleConfig, optimizer: torch.optim.Optimizer) -> Any:
    """``schedule.target(optimizer, **args)`` (with ``mode=schedule.mode`` when set), checked."""
    extra = {"mode": cfg.mode} if cfg.mode is not None else {}
    if extra and "mode" in cfg.args:
        raise ConfigError("schedule.mode and schedule.args.mode are both set; keep schedule.mode")
    scheduler = build_target(cfg.target, cfg.args, "schedule", call_args=(optimizer,), call_kwargs=extra)
    if not all(callable(getattr(scheduler, m, None)) for m in ("step", "state_dict", "load_state_dict")):
        raise ConfigError(
            f"schedule.target={cfg.target!r} returned {type(scheduler).__name__}; it must return a "
            "learning-rate scheduler (step(), state_dict(), load_state_dict()), e.g. torch.optim.lr_scheduler:StepLR"
        )
    return scheduler


def _steps_on_a_metric(scheduler: Any) -> bool:
    """Whether ``scheduler.step`` needs a value (``ReduceLROnPlateau.step(metrics)``), not an epoch."""
    try:
        params = list(inspect.signature(scheduler.step).parameters.values())
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0].name != "epoch" and params[0].default is inspect.Parameter.empty


def add_train_loss(scheduler: Any, loss: torch.Tensor) -> None:
    """After each applied step: its loss, for a ``TargetSchedule`` monitoring ``train_loss``."""
    if isinstance(scheduler, TargetSchedule):
        scheduler.add_train_loss(loss)


def epoch_ended(scheduler: Any) -> None:
    """At each epoch's end: steps a ``TargetSchedule`` with ``interval="epoch"``."""
    if isinstance(scheduler, TargetSchedule):
        scheduler.epoch_ended()


def validated(scheduler: Any, metrics: Mapping[str, float]) -> None:
    """After each validation: steps a ``TargetSchedule`` with a ``monitor``."""
    if isinstance(scheduler, TargetSchedule):
        scheduler.validated(metrics)


def end_at_floor(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Set every group's learning rate to where its schedule ends (``min_lr``, or ``lr`` for a
    constant schedule), for a run whose last step comes before the planned one. A
    ``TargetSchedule`` follows its own arguments: nothing to do."""
    if not isinstance(scheduler, TargetSchedule):
        set_lr_at(scheduler, optimizer, 2**62)


def replan(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """After a resume: the built-in schedule's rates from this run's plan at the step reached
    (``set_lr_at``); a ``TargetSchedule`` continues from its saved state as it is."""
    if not isinstance(scheduler, TargetSchedule):
        set_lr_at(scheduler, optimizer, scheduler.last_epoch)


def scale_schedule(scheduler: Any, optimizer: torch.optim.Optimizer, scale: float) -> None:
    """Every group's schedule at ``scale`` × its initial learning rate, from this step on (a
    rollback's back-off); it survives a checkpoint through the scheduler's state."""
    if isinstance(scheduler, TargetSchedule):
        scheduler.scale_lr(scale)
        return
    scheduler.base_lrs = [group["initial_lr"] * scale for group in optimizer.param_groups]
    set_lr_at(scheduler, optimizer, scheduler.last_epoch)


def set_lr_at(scheduler: torch.optim.lr_scheduler.LambdaLR, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Set every group's learning rate to its schedule's at ``step`` (0-based optimizer step).

    After a resume, ``set_lr_at(s, o, s.last_epoch)``: the optimizer's saved rates are the old
    plan's, and a plan changed on resume (``max_steps``, warmup, decay) applies from the first
    resumed step, not the second. With an unchanged plan the rates come out bit for bit the same.
    """
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(step)
