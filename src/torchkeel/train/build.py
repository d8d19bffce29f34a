"""Turn the config's import paths into the objects the Trainer composes, checking what comes back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchkeel.config.imports import build_target, resolve_target
from torchkeel.config.schema import LossConfig, ModelConfig
from torchkeel.errors import ConfigError
from torchkeel.distributed.rank import RankInfo
from torchkeel.train.objective import Objective


def resolve_device(name: str, rank: RankInfo | None = None) -> torch.device:
    """``auto`` → cuda, then mps, then cpu. Under torchrun each rank takes GPU ``LOCAL_RANK``.

    Raises:
        ConfigError: the named device is not available in this torch build or machine.
    """
    local_rank = (rank or RankInfo()).local_rank
    if name == "auto":
        if torch.cuda.is_available():
            name = "cuda"
        elif torch.backends.mps.is_available():
            name = "mps"
        else:
            name = "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ConfigError(
                f"device=cuda but no CUDA device is usable (torch {torch.__version__}, {build}); "
                "use device=auto or device=cpu, or run `keel doctor`"
            )
        # Before anything else touches CUDA, or every rank lands on GPU 0.
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if name == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device=mps but MPS is not available here; use device=auto or device=cpu")
    return torch.device(name)


def build_model(cfg: ModelConfig) -> torch.nn.Module:
    """Call ``model.target(**model.args)``; it must return an ``nn.Module``."""
    if cfg.target is None:
        raise ConfigError("model.target is not set; give a 'module:callable' that returns an nn.Module")
    model = build_target(cfg.target, cfg.args, "model")
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"model.target={cfg.target!r} returned {type(model).__name__}; it must return a torch.nn.Module"
        )
    return model


def build_objective(cfg: LossConfig, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                    model: torch.nn.Module | None = None) -> Objective:
    """The ``Objective``: ``loss.step_fn`` if set, else ``loss_fn`` (or ``loss.target``), with
    ``loss.count_key``; ``model`` decides ``loss.shift_labels: null``."""
    shift = cfg.shift_labels if cfg.shift_labels is not None else model is not None and predicts_next_token(model)
    counting = dict(count_key=cfg.count_key, ignore_index=cfg.ignore_index, shift_labels=shift)
    if cfg.step_fn is not None:
        return Objective(step_fn=resolve_target(cfg.step_fn, "loss.step_fn"), **counting)
    return Objective(loss_fn if loss_fn is not None else build_loss(cfg), **counting)


def build_loss(cfg: LossConfig) -> Callable[[Any, Any], torch.Tensor]:
    """Call ``loss.target(**loss.args)``; it must return a callable ``loss(output, target)``."""
    loss_fn = build_target(cfg.target, cfg.args, "loss")
    if not callable(loss_fn):
        raise ConfigError(
            f"loss.target={cfg.target!r} returned {type(loss_fn).__name__}; "
            "it must return a callable loss(output, target) (e.g. torch.nn:CrossEntropyLoss)"
        )
    return loss_fn


def predicts_next_token(model: torch.nn.Module) -> bool:
    """A transformers model whose loss shifts the labels by one (its causal-LM loss)."""
    try:
        loss = getattr(model, "loss_function", None)
    except Exception:  # noqa: BLE001 - a property of someone else's class: no answer is "no"
        return False
    if getattr(loss, "__name__", "") == "ForCausalLMLoss":
        return True
    kind = type(model)
    return kind.__module__.startswith("transformers.") and kind.__name__.endswith(("ForCausalLM", "LMHeadModel"))
