"""Build the optimizer named in the config, or the user's own by import path."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchkeel.config.imports import build_target
from torchkeel.config.schema import OptimConfig
from torchkeel.errors import ConfigError

_BUILTIN = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
_FUSED_FOR_DTENSOR = (torch.optim.AdamW, torch.optim.Adam)  # DTensor registers _fused_adam(w)_, not _fused_sgd_


def build_optimizer(cfg: OptimConfig, params: Sequence[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``cfg.target`` (if set) or the built-in ``cfg.name``, with ``lr``, ``weight_decay`` and ``args``.

    A built-in optimizer whose ``args`` say neither ``fused`` nor ``foreach`` is fused where
    torch has a fused kernel for the parameters' device and dtype (AdamW, Adam and SGD on CUDA
    and the CPU), else multi-tensor (``foreach``): the same update, in fewer kernel launches.
    FSDP2's sharded parameters (DTensors) have a fused kernel for AdamW and Adam only."""
    common = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    if cfg.target is not None:
        optimizer = build_target(cfg.target, cfg.args, "optim", call_args=(list(params),), call_kwargs=common)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optim.target={cfg.target!r} returned {type(optimizer).__name__}; "
                "it must return a torch.optim.Optimizer"
            )
        return optimizer
    cls = _BUILTIN[cfg.name]
    params = list(params)
    if not {"fused", "foreach"} & set(cfg.args):
        if cls in _FUSED_FOR_DTENSOR or not _has_dtensor(params):
            try:  # the fastest correct kernel: one fused update of every tensor, where torch has it
                return cls(params, **common, **cfg.args, fused=True)
            except (RuntimeError, ValueError, TypeError):
                pass  # not for this device or dtype: the multi-tensor one (torch's own default on CUDA)
        try:
            return cls(params, **common, **cfg.args, foreach=True)
        except (RuntimeError, ValueError, TypeError):
            pass
    try:
        return cls(params, **common, **cfg.args)
    except TypeError as exc:
        raise ConfigError(f"optim.args do not fit {cls.__name__}: {exc}; fix the keys under optim.args") from None


def _has_dtensor(params: Sequence[torch.nn.Parameter]) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)
