"""Global gradient norm and clipping, kept on the device (no host sync)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
