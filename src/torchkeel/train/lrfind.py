"""The learning-rate range test: train a copy with the rate rising exponentially, and suggest one.

Each step trains at a rate from ``min_lr`` to ``max_lr``, spaced evenly in log scale, on the
run's own data, model, loss and optimizer (built from the config as ``keel train`` builds
them: nothing is written to the run directory). The loss is smoothed (an exponential average,
bias-corrected); the test stops once the smoothed loss exceeds 4 times its lowest, or the loss
is NaN/Inf. The suggestion is the rate where the smoothed loss falls fastest (its steepest
slope against log rate) before its lowest point — a rate that still learns fast, well short of
divergence. A model passed in gets its weights back at the end.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchkeel.config.schema import KeelConfig
from torchkeel.distributed.job import TrainingJob
from torchkeel.distributed.rank import RankInfo
from torchkeel.errors import ConfigError, MissingExtraError
from torchkeel.train.build import build_training, resolve_device
from torchkeel.train.precision import make_precision
from torchkeel.train.step import StepSettings, train_step

SMOOTHING = 0.9
DIVERGED = 4.0
"""The test stops when the smoothed loss exceeds this many times its lowest."""
SKIP_START = 0.1
"""The first tenth of the points is left out of the suggestion: the average is still settling."""


@dataclass
class RangeTest:
    """What the range test found: the rates tried, their losses, the suggested rate and why it stopped."""

    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    smoothed: list[float] = field(default_factory=list)
    suggestion: float | None = None
    stopped: str = "reached max_lr"

    def describe(self) -> str:
        if self.suggestion is None:
            return f"no suggestion: the loss did not fall over {len(self.lrs)} steps ({self.stopped})"
        return (
            f"suggested lr {self.suggestion:.2e}: the smoothed loss falls fastest there "
            f"({len(self.lrs)} steps from {self.lrs[0]:.1e} to {self.lrs[-1]:.1e}; {self.stopped})"
        )


def find_lr(
    cfg: KeelConfig,
    *,
    min_lr: float = 1e-7,
    max_lr: float = 1.0,
    steps: int = 100,
    model: torch.nn.Module | None = None,
    train_data: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
) -> RangeTest:
    """Run the range test on the model, data and optimizer ``cfg`` describes (or those given)."""
    if not 0 < min_lr < max_lr:
        raise ConfigError(f"the range test needs 0 < --min < --max, got {min_lr:g} and {max_lr:g}")
    if steps < 10:
        raise ConfigError(f"the range test needs at least 10 steps, got {steps}")
    kept = copy.deepcopy(model.state_dict()) if model is not None else None
    device = resolve_device(cfg.device)
    job = TrainingJob(cfg.dist, RankInfo(0, 1, 0), device)
    try:
        built = build_training(cfg, job, model, train_data, None, loss_fn)
        precision = make_precision(cfg.precision, device)
        settings = StepSettings(
            built.params, precision, device, clip_grad_norm_max=cfg.train.clip_grad_norm, check_finite=True
        )
        batches = _forever(built.data.train)
        found = RangeTest()
        best, average = math.inf, 0.0
        for i in range(steps):
            lr = min_lr * (max_lr / min_lr) ** (i / (steps - 1))
            for group in built.optimizer.param_groups:
                group["lr"] = lr
            micro_batches = [next(batches) for _ in range(cfg.train.accumulate)]
            result = train_step(built.forward_model, built.optimizer, micro_batches, built.objective, settings)
            loss = result.loss_value
            if loss is None or not math.isfinite(loss):
                found.stopped = f"the loss became non-finite at lr {lr:.1e}"
                break
            average = SMOOTHING * average + (1 - SMOOTHING) * loss
            smoothed = average / (1 - SMOOTHING ** (i + 1))
            found.lrs.append(lr)
            found.losses.append(loss)
            found.smoothed.append(smoothed)
            if smoothed > DIVERGED * best:
                found.stopped = f"the loss diverged at lr {lr:.1e}"
                break
            best = min(best, smoothed)
        found.suggestion = steepest(found.lrs, found.smoothed)
        return found
    finally:
        job.close()
        if model is not None and kept is not None:
            model.load_state_dict(kept)


def steepest(lrs: list[float], smoothed: list[float]) -> float | None:
    """The rate where ``smoothed`` falls fastest against log rate, before its lowest point."""
    if len(lrs) < 10:
        return None
    lowest = min(range(len(smoothed)), key=smoothed.__getitem__)
    start = max(1, int(len(lrs) * SKIP_START))
    slopes = [
        ((smoothed[i + 1] - smoothed[i - 1]) / (math.log(lrs[i + 1]) - math.log(lrs[i - 1])), i)
        for i in range(start, min(lowest, len(lrs) - 1))
    ]
    if not slopes:
        return None
    slope, at = min(slopes)
    return lrs[at] if slope < 0 else None


def plot(found: RangeTest, path: str | Path) -> Path:
    """Loss against learning rate (log scale) into a PNG, the suggestion marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingExtraError("report", "matplotlib", "the range test's plot") from None
    fig, ax = plt.subplots(figsize=(8.0, 4.0), dpi=100)
    ax.plot(found.lrs, found.losses, color="0.75", linewidth=0.8, label="loss")
    ax.plot(found.lrs, found.smoothed, color="tab:blue", label="smoothed")
    if found.suggestion is not None:
        ax.axvline(found.suggestion, color="tab:red", linestyle="--", label=f"suggested {found.suggestion:.1e}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def _forever(loader: Any) -> Iterator[Any]:
    epoch = 0
    while True:
        yield from loader.epoch(epoch)
        epoch += 1
