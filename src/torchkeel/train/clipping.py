"""Global gradient norm and clipping, kept on the device (no host sync); how often clipping acts.

``ClipRate`` counts the applied steps whose gradient norm exceeded ``max_norm`` (the steps the
clipping rescaled): per log window (``clip_frac`` in the training rows) and over the run's first
``EARLY_STEPS`` steps, where more than half rescaled is worth a warning. A default clip that acts
on most steps changes the training from what a plain loop computes; said once, a person can
decide.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

EARLY_STEPS = 100
"""The first optimizer steps judged for the clipping warning (all of a shorter run's). Long enough
that the large norms of a language model's first steps, which a clip of 1.0 is there for, are
not a majority (nanoGPT's shakespeare_char port clipped 38-45 of its first 50 steps and at most
3 of the next 50, over six seeds); early enough to be read while the run is young (the mnist
port clipped 99 % of all its steps)."""


def clip_grad_norm(params: Sequence[torch.nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Clip the global L2 norm of ``params``' gradients to ``max_norm``; return the norm before clipping.

    ``max_norm=None`` only measures. The norm stays a device tensor: reading it (``.item()``) is
    the caller's choice, once per logged step, not once per micro-batch. Call it after
    ``Precision.unscale_`` so the norm is of the true gradients.
    """
    if max_norm is None:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros((), device=params[0].device if params else None)
        if _is_sharded(grads[0]):
            return _full(torch.nn.utils.get_total_norm(grads))
        return torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.detach(), dtype=torch.float32) for g in grads])
        )
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm if type(norm) is torch.Tensor else _full(norm)


def _is_sharded(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor"


def _full(norm: torch.Tensor) -> torch.Tensor:
    """FSDP2's gradients are sharded (DTensor): their norm is reduced over the ranks here."""
    return norm.full_tensor() if _is_sharded(norm) else norm


@dataclass(frozen=True)
class ClipWarning:
    """More than half of the first steps were rescaled by clipping."""

    step: int
    """The step it was judged at (``EARLY_STEPS``, or a shorter run's last)."""
    first_step: int
    """The first step judged (a run resumed before ``EARLY_STEPS`` judges the steps it saw)."""
    num_steps: int
    num_clipped: int
    median_grad_norm: float
    max_norm: float

    @property
    def message(self) -> str:
        return (
            f"gradient clipping rescaled {self.num_clipped} of {self.num_steps} steps ({self.first_step}-{self.step}); "
            f"median gradient norm {self.median_grad_norm:.3g} > train.clip_grad_norm {self.max_norm:g}, so clipping "
            "changes most updates. If the script you follow does not clip, set train.clip_grad_norm: null; to clip "
            f"only spikes, raise it above the typical norm ({self.median_grad_norm:.2g})"
        )

    def row(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` row (kind ``clipping``) that ``keel report`` shows."""
        return {
            "kind": "clipping",
            "step": self.step,
            "first_step": self.first_step,
            "num_steps": self.num_steps,
            "num_clipped": self.num_clipped,
            "median_grad_norm": self.median_grad_norm,
            "clip_grad_norm": self.max_norm,
            "message": self.message,
        }


class ClipRate:
    """How often clipping to ``max_norm`` rescaled the gradients (``None``: no clipping, nothing counted).

    ``add`` each step's gradient norm (before clipping); ``window_frac`` at a log step (the fraction of the applied steps
    since the previous call); ``early_warning`` after each step gives a ``ClipWarning`` once, at
    step ``early_steps`` (or ``is_last``), when more than half of the steps up to it were rescaled.
    Skipped steps (non-finite, fp16 overflow) are not counted. No host sync and no device work per
    step: a norm the guard read is compared on the host; one it did not is kept, and the window's
    are compared in one go at ``window_frac`` (one sync, log steps only), the first steps' once
    for the warning.
    """

    FOLD_EVERY = 1024
    """Norms kept on the device before they are counted there (a long log window stays small)."""

    def __init__(self, max_norm: float | None, early_steps: int = EARLY_STEPS) -> None:
        self.max_norm, self.early_steps = max_norm, early_steps
        self._steps, self._clipped = 0, 0
        self._on_device: list[torch.Tensor] = []
        self._clipped_on_device: torch.Tensor | None = None
        self._early: list[float | torch.Tensor] = []
        self._first_step: int | None = None
        self._judged = False

    def add(self, step: int, grad_norm: float | torch.Tensor, *, applied: bool = True) -> None:
        """Count step ``step`` (counted from 1) and its gradient norm before clipping: a float read
        on the host, or the device tensor ``clip_grad_norm`` returned. ``applied=False``: the
        step was skipped (non-finite, fp16 overflow), not counted."""
        if self.max_norm is None or not applied:
            return
        self._steps += 1
        norm = grad_norm
        if isinstance(norm, float):
            self._clipped += norm > self.max_norm
        else:
            self._on_device.append(norm)
            if len(self._on_device) >= self.FOLD_EVERY:
                self._clipped_on_device = self._count_on_device()
        if step <= self.early_steps and not self._judged:
            self._first_step = self._first_step or step
            self._early.append(norm)

    def _count_on_device(self) -> torch.Tensor:
        """The kept norms above ``max_norm``, counted on the device with those counted before."""
        over = (torch.stack(self._on_device) > self.max_norm).sum()
        self._on_device = []
        return over if self._clipped_on_device is None else self._clipped_on_device + over

    def window_frac(self) -> float | None:
        """The fraction of the applied steps since the last call that clipping rescaled (``None``: none applied)."""
        if self.max_norm is None or not self._steps:
            return None
        clipped = self._clipped
        if self._on_device or self._clipped_on_device is not None:
            clipped += int(self._count_on_device().item())  # host sync, log steps only
        frac = clipped / self._steps
        self._steps, self._clipped, self._clipped_on_device = 0, 0, None
        return frac

    def early_warning(self, step: int, is_last: bool = False) -> ClipWarning | None:
        """After step ``step``: the warning, once, when the first steps were mostly rescaled."""
        if self._judged or self.max_norm is None or (step < self.early_steps and not is_last):
            return None
        self._judged = True
        early, self._early = self._early, []
        tensors = [n for n in early if isinstance(n, torch.Tensor)]
        read = iter(torch.stack(tensors).tolist() if tensors else [])  # host sync, once a run
        norms = [n if isinstance(n, float) else next(read) for n in early]
        norms = [n for n in norms if math.isfinite(n)]
        clipped = sum(n > self.max_norm for n in norms)
        if not norms or clipped * 2 <= len(norms):
            return None
        assert self._first_step is not None
        return ClipWarning(step, self._first_step, len(norms), clipped, statistics.median(norms), self.max_norm)
