"""Learning-rate schedule by optimizer step: linear warmup, then cosine, linear or constant decay."""

from __future__ import annotations

import functools
import math

import torch


def lr_at(
    step: int,
    *,
    lr: float,
    warmup_steps: int,
    total_steps: int,
    decay: str = "cosine",
    min_lr: float = 0.0,
) -> float:
    """Learning rate of optimizer step ``step`` (0-based).

    Warmup: step ``s < warmup_steps`` uses ``lr * (s + 1) / warmup_steps``, so the last warmup
    step reaches ``lr``. Decay then runs from ``lr`` at step ``warmup_steps`` to ``min_lr`` at
    step ``total_steps - 1`` and stays there.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay == "constant":
        return lr
    span = max(total_steps - 1 - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
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
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` that follows ``lr_at`` for every param group, relative to its own initial lr.

    Call ``scheduler.step()`` once per optimizer step. ``min_lr`` is absolute for the first
    param group; other groups keep the same ratio.
    """
    base_lr = optimizer.param_groups[0]["lr"]
    factor = functools.partial(
        _factor,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        decay=decay,
        min_ratio=min_lr / base_lr,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _factor(step: int, *, warmup_steps: int, total_steps: int, decay: str, min_ratio: float) -> float:
    return lr_at(step, lr=1.0, warmup_steps=warmup_steps, total_steps=total_steps, decay=decay, min_lr=min_ratio)


def end_at_floor(scheduler: torch.optim.lr_scheduler.LambdaLR, optimizer: torch.optim.Optimizer) -> None:
    """Set every group's learning rate to where its schedule ends (``min_lr``, or ``lr`` for a
    constant schedule), for a run whose last step comes before the planned one."""
    set_lr_at(scheduler, optimizer, 2**62)


def set_lr_at(scheduler: torch.optim.lr_scheduler.LambdaLR, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Set every group's learning rate to its schedule's at ``step`` (0-based optimizer step).

    After a resume, ``set_lr_at(s, o, s.last_epoch)``: the optimizer's saved rates are the old
    plan's, and a plan changed on resume (``max_steps``, warmup, decay) applies from the first
    resumed step, not the second. With an unchanged plan the rates come out bit for bit the same.
    """
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(step)
