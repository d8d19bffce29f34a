"""Decisions every rank must take identically, agreed through one collective.

Each helper returns its input unchanged in a single process, so components call it
unconditionally and stay correct once they run under torchrun.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch
import torch.distributed as dist

_IS_CPU = operator.attrgetter("is_cpu")
_DIST_BUILT = dist.is_available()


def any_rank(flag: bool, device: torch.device | None = None) -> bool:
    """True on every rank if ``flag`` is true on any rank (a stop signal, a non-finite step...)."""
    return any_rank_flags([flag], device)[0]


def any_rank_flags(flags: list[bool], device: torch.device | None = None) -> list[bool]:
    """``any_rank`` of several flags in one collective. A decision only rank 0 can take (by its
    clock, say) is passed as ``decision if rank.is_main else False``."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(flags)
    values = torch.tensor([int(f) for f in flags], device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [bool(v) for v in values.tolist()]  # host sync: the decisions are needed on the host


def read_finite(values: torch.Tensor | Sequence[torch.Tensor], agreed: bool = False) -> tuple[list[float], list[bool]]:
    """Read a 1-D tensor (or scalar tensors) to the host and say, per entry, whether it is
    finite on every rank.

    One host sync. In a single process the check happens on the host; under torchrun the
    finiteness flags are agreed on the device first (one all-reduce), so that every rank
    decides the same even when only one rank's loss went NaN. ``agreed``: the values are
    already the same on every rank (reduced), so no collective is needed.
    """
    local = agreed or not (_DIST_BUILT and dist.is_initialized())
    if not isinstance(values, torch.Tensor):
        if local and all(map(_IS_CPU, values)):  # no sync to save: no stack either
            host = list(map(float, values))  # map, not comprehensions: this runs every step
            return host, list(map(math.isfinite, host))
        values = torch.stack([v.float() for v in values])
    if local:
        host = values.tolist()
        return host, [math.isfinite(v) for v in host]
    flags = agree_all(torch.isfinite(values)).to(values.dtype)
    host = torch.cat([values, flags]).tolist()
    n = values.numel()
    return host[:n], [bool(f) for f in host[n:]]


def agree_all(flags: torch.Tensor) -> torch.Tensor:
    """Element-wise AND of boolean ``flags`` across ranks, on the device (no host sync here)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flags
    values = flags.to(torch.int32)
    dist.all_reduce(values, op=dist.ReduceOp.MIN)
    return values.bool()


def agree_min(value: int | None, device: torch.device | None = None) -> int | None:
    """The smallest ``value`` over all ranks (``None``: no limit), e.g. the micro-batch size that fits."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    no_limit = torch.iinfo(torch.int64).max
    tensor = torch.tensor([no_limit if value is None else value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    smallest = int(tensor.item())  # host sync: the size is needed on the host
    return None if smallest == no_limit else smallest
