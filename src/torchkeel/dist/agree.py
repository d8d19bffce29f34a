"""Decisions every rank must take identically, agreed through one collective.

Each helper returns its input unchanged in a single process, so components call it
unconditionally and stay correct once they run under torchrun.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def any_rank(flag: bool, device: torch.device | None = None) -> bool:
    """True on every rank if ``flag`` is true on any rank (a stop signal, a non-finite step...)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())  # host sync: the decision is needed on the host


def agree_all(flags: torch.Tensor) -> torch.Tensor:
    """Element-wise AND of boolean ``flags`` across ranks, on the device (no host sync here)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flags
    values = flags.to(torch.int32)
    dist.all_reduce(values, op=dist.ReduceOp.MIN)
    return values.bool()
