"""Early stopping: end training after ``patience`` validations without improvement.

Its state (the best value, when it was seen, the validations since) goes into every checkpoint,
so a resumed run stops at the very validation an uninterrupted one would. Every rank sees the
same validation metrics (they are reduced over the ranks), so every rank decides the same.
"""

from __future__ import annotations

import math
from typing import Any

from torchkeel.errors import ConfigError


class EarlyStopping:
    """``observe(metrics, step)`` after each validation; ``stop_reason`` once it should stop.

    Example::

        stopper = EarlyStopping("val_loss", "min", patience=3)
        for epoch in range(100):
            train_one_epoch()
            improved = stopper.observe({"val_loss": validate()}, step)
            if improved:
                save_checkpoint()
            if stopper.stop_reason:
                break
    """

    def __init__(self, monitor: str, mode: str, patience: int, min_delta: float = 0.0) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, min_delta
        self.best: float | None = None
        self.best_step: int | None = None
        self.bad_validations = 0
        self.stop_reason: str | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> EarlyStopping | None:
        """From ``train.early_stop`` of a ``KeelConfig`` (monitor and mode default to the checkpoint's);
        ``None`` when ``patience`` is 0 (off)."""
        es, ck = cfg.train.early_stop, cfg.checkpoint
        return cls(es.monitor or ck.monitor, es.mode or ck.mode, es.patience, es.min_delta) if es.patience else None

    def observe(self, metrics: dict[str, float], step: int) -> bool:
        """Count one validation; True when it improved on the best by more than ``min_delta``.

        Raises:
            ConfigError: the monitored metric is not among the validation's metrics.
        """
        if self.monitor not in metrics:
            raise ConfigError(
                f"train.early_stop.monitor={self.monitor!r} is not a validation metric; "
                f"this run logs {', '.join(sorted(metrics)) or 'none'}"
            )
        value = float(metrics[self.monitor])
        sign = 1.0 if self.mode == "min" else -1.0
        improved = not math.isnan(value) and (self.best is None or sign * (self.best - value) > self.min_delta)
        if improved:
            self.best, self.best_step, self.bad_validations = value, step, 0
        else:
            self.bad_validations += 1
            if self.bad_validations >= self.patience:
                self.stop_reason = (
                    f"{self.monitor} did not improve on {self.best:.6g} (step {self.best_step}) "
                    f"by more than {self.min_delta:g} in {self.bad_validations} validations"
                )
        return improved

    def after(self, metrics: dict[str, float], step: int, *, defer: bool = False) -> tuple[bool, bool]:
        """``observe`` one validation and say when to save: ``(now, at the epoch's end)``. The best
        state goes to disk when the metric improved, and the last state when it says stop;
        ``defer`` leaves an improvement's save to the epoch end (a validation at its last batch)."""
        improved = self.observe(metrics, step)
        if self.stop_reason or (improved and not defer):
            return True, False
        return False, improved

    def summary(self) -> dict[str, Any]:
        """Why and where it stopped, for ``summary.json``."""
        return {"reason": self.stop_reason, "best_step": self.best_step, "best": self.best}

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "best_step": self.best_step,
            "bad_validations": self.bad_validations,
            "stop_reason": self.stop_reason,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_step = state["best"], state["best_step"]
        self.bad_validations, self.stop_reason = state["bad_validations"], state["stop_reason"]
