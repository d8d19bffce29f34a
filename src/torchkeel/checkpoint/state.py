"""Capture and restore everything a run needs to continue exactly: weights, optimizer, schedule,
scaler, every RNG, and the caller's progress counters."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from torchkeel.errors import CheckpointError
from torchkeel.rng import capture_rng, restore_rng


@contextlib.contextmanager
def leaving_no_trace(module: torch.nn.Module) -> Iterator[None]:
    """Run extra forward passes of ``module`` (a replay, a trace) without changing what comes
    after: the RNG states and the module's buffers (batch-norm statistics) are restored on exit."""
    rng = capture_rng()
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        restore_rng(rng)


def capture_training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    scaler: Any = None,
    progress: Mapping[str, Any] | None = None,
    protections: Mapping[str, Any] | None = None,
    weights: bool = True,
) -> dict[str, Any]:
    """The state dict of a run. Tensors are live references: ``snapshot`` before saving asynchronously.
    ``weights=False`` leaves out the model and optimizer (a sharded save writes them itself)."""
    return {
        **({"model": model.state_dict(), "optimizer": optimizer.state_dict()} if weights else {}),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "rng": capture_rng(),
        "progress": dict(progress or {}),
        "protections": dict(protections or {}),
    }


def restore_training_state(
    state: Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
) -> dict[str, Any]:
    """Load ``state`` into the objects given and restore the RNGs; return the progress counters.

    Raises:
        CheckpointError: the model's parameters differ from the checkpoint's (keys listed).
    """
    if "model" in state:  # not in a sharded checkpoint's state: see torchkeel.checkpoint.sharded
        load_model_weights(model, state["model"], strict=True, source="checkpoint")
    if optimizer is not None and "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    restore_rng(state["rng"])
    return dict(state.get("progress") or {})


def load_model_weights(
    model: torch.nn.Module, weights: Mapping[str, torch.Tensor], *, strict: bool, source: str
) -> list[str]:
    """Copy ``weights`` into ``model``; return the keys that were not loaded (non-strict only).

    With ``strict``, any missing, unexpected or shape-mismatched key is a ``CheckpointError``
    that lists them. Without it, matching keys are loaded and the rest reported back.
    """
    own = model.state_dict()
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    mismatched = sorted(
        f"{k} (checkpoint {tuple(weights[k].shape)}, model {tuple(own[k].shape)})"
        for k in set(own) & set(weights)
        if tuple(weights[k].shape) != tuple(own[k].shape)
    )
    if strict and (missing or unexpected or mismatched):
        parts = [
            f"{label}: {_preview(keys)}"
            for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched))
            if keys
        ]
        raise CheckpointError(
            f"the model does not match the {source} — {'; '.join(parts)}. A renamed or resized module? "
            "Use the model the checkpoint was saved from, or init_strict=false to load the matching weights only"
        )
    skipped_shapes = {k.split(" ")[0] for k in mismatched}
    loadable = {k: v for k, v in weights.items() if k in own and k not in skipped_shapes}
    model.load_state_dict(loadable, strict=False)
    return missing + unexpected + mismatched


def _preview(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
