"""Mixed precision done right: autocast for the forward, a GradScaler for fp16, unscale before clipping.

``Precision`` is the one object the step asks for these four things, so a hand-written loop
gets the same order by calling ``autocast()``, ``backward()``, ``unscale_()`` and ``step()``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ContextManager, Protocol

import torch

from torchkeel.errors import ConfigError

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_NO_AUTOCAST = contextlib.nullcontext()


class GradScalerLike(Protocol):
    """What ``Precision`` needs of ``torch.amp.GradScaler`` (tests pass a stand-in)."""

    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None: ...
    def step(self, optimizer: torch.optim.Optimizer) -> Any: ...
    def update(self) -> None: ...


@dataclass
class Precision:
    """Autocast dtype (None: fp32) and the optional loss scaler for one device type."""

    device_type: str = "cpu"
    dtype: torch.dtype | None = None
    scaler: GradScalerLike | None = None

    def autocast(self) -> ContextManager[Any]:
        """Context for the forward pass and the loss."""
        if self.dtype is None:
            return _NO_AUTOCAST
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss``, scaled when a scaler is in use."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true scale; call once per step, before clipping."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Optimizer step (through the scaler, which skips steps with inf/NaN gradients)."""
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()

    def skip(self, optimizer: torch.optim.Optimizer) -> None:
        """Do not apply this step; keep the scaler's bookkeeping (its found-inf state) consistent."""
        if self.scaler is not None:
            self.scaler.update()


def make_precision(name: str, device: torch.device) -> Precision:
    """``Precision`` for config value ``fp32``/``bf16``/``fp16`` on ``device``.

    Raises:
        ConfigError: fp16 on a device without GradScaler support (use bf16 there).
    """
    if name not in _DTYPES:
        raise ConfigError(f"precision must be one of {', '.join(_DTYPES)}, got {name!r}")
    dtype = _DTYPES[name]
    scaler = None
    if name == "fp16":
        if device.type != "cuda":
            raise ConfigError(f"precision fp16 needs a CUDA device (got {device.type}); use precision=bf16")
        scaler = torch.amp.GradScaler("cuda")
    return Precision(device_type=device.type, dtype=dtype, scaler=scaler)
