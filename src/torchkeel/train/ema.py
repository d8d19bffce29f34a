"""An exponential moving average of the weights, with ``torch.optim.swa_utils.AveragedModel``.

``ema = decay * ema + (1 - decay) * weights`` after each applied optimizer step (a step the
guard skipped is not averaged in); the first update copies the weights. Buffers (batch-norm
statistics) are averaged too. The average lives in the checkpoint, so a resumed run continues
it bitwise; validation and export use it when it is on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

EMA_PREFIX = "module."  # AveragedModel's state dict: n_averaged and module.<name>


class WeightAverage:
    """Example::

    ema = WeightAverage(model, decay=0.999)
    for step, batch in enumerate(batches, 1):
        train_one_step(model, batch)
        ema.update(step)
    evaluate(ema.module, ...)
    """

    def __init__(self, model: torch.nn.Module, decay: float, start_step: int = 0) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.model, self.decay, self.start_step = model, decay, start_step
        self.averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)

    @property
    def module(self) -> torch.nn.Module:
        """The averaged model (a copy of the model's structure), for validation and export."""
        return self.averaged.module

    def update(self, step: int) -> None:
        """Average the current weights in, from ``start_step`` on (call after an applied step)."""
        if step >= self.start_step:
            self.averaged.update_parameters(self.model)

    def state_dict(self) -> dict[str, Any]:
        return self.averaged.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.averaged.load_state_dict(state)


def averaged_weights(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model state dict inside a ``WeightAverage.state_dict()`` (``n_averaged`` left out)."""
    return {k[len(EMA_PREFIX) :]: v for k, v in state.items() if k.startswith(EMA_PREFIX)}
