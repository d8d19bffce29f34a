"""Build the optimizer named in the config, or the user's own by import path, over parameter groups.

Groups, in this order: each parameter joins the first of ``optim.groups`` whose pattern matches
its name (the rest form the default group, first, with ``optim.lr`` and ``optim.weight_decay``);
then ``optim.decay_filter`` splits every group into the parameters that get its weight decay and
those that get none. Empty groups are left out; a pattern that matches nothing is an error.
"""

from __future__ import annotations

import difflib
import fnmatch
import inspect
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torchkeel.config.imports import build_target
from torchkeel.config.schema import OptimConfig
from torchkeel.errors import ConfigError

_FUSED_FOR_DTENSOR = (torch.optim.AdamW, torch.optim.Adam)  # DTensor registers _fused_adam(w)_, not _fused_sgd_
_NEEDS_CLOSURE = ("lbfgs",)  # step(closure) re-evaluates the model: not one step per batch
# transformers' Trainer (get_decay_parameter_names): no decay inside a LayerNorm, nor on a
# parameter whose lower-cased dotted name matches one of these.
_NO_DECAY_NAMES = tuple(map(re.compile, (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")))


def optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    """Every optimizer class of ``torch.optim`` by its lower-cased name (``optim.name``'s choices)."""
    return {
        name.lower(): obj
        for name, obj in vars(torch.optim).items()
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer
    }


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class ``name`` names, case-insensitive.

    Raises:
        ConfigError: no such optimizer, or one whose step needs a closure (LBFGS).
    """
    classes = optimizer_classes()
    key = name.lower()
    if key in _NEEDS_CLOSURE:
        raise ConfigError(
            f"optim.name={name!r} steps with a closure that re-evaluates the model, which one step per "
            "batch does not give; choose another optimizer, or write the loop with torchkeel's components"
        )
    if key not in classes:
        valid = sorted(k for k in classes if k not in _NEEDS_CLOSURE)
        hint = difflib.get_close_matches(key, valid, n=1)
        extra = f"did you mean '{hint[0]}'? " if hint else ""
        raise ConfigError(
            f"optim.name={name!r} is not an optimizer of torch.optim; {extra}valid names (any case): "
            f"{', '.join(valid)}; or set optim.target to a factory"
        )
    return classes[key]


@dataclass
class ParamGroup:
    """One optimizer param group as built from the config, with the names of its parameters."""

    name: str
    """Where it comes from: ``default`` or ``optim.groups[i]``, with ``no decay`` for the filter's rest."""
    names: list[str]
    params: list[torch.nn.Parameter]
    lr: float
    weight_decay: float

    def row(self) -> dict[str, Any]:
        """The group for the run's start report: how many tensors and parameters, lr, weight decay."""
        return {
            "group": self.name,
            "num_tensors": len(self.params),
            "num_params": sum(p.numel() for p in self.params),
            "lr": self.lr,
            "weight_decay": self.weight_decay,
        }


def describe_groups(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The start report's console lines for ``ParamGroup.row``s: one a group, none when the config
    does not split the parameters (a single ``default`` group)."""
    if len(rows) == 1 and rows[0]["group"] == "default":
        return []
    return [
        f"optimizer group {r['group']}: {r['num_tensors']} tensors, {r['num_params']:,} parameters, "
        f"lr {r['lr']:g}, weight_decay {r['weight_decay']:g}"
        for r in rows
    ]


def param_groups(
    cfg: OptimConfig, named_params: Iterable[tuple[str, torch.nn.Parameter]], model: torch.nn.Module | None = None
) -> list[ParamGroup]:
    """``optim.groups`` by name pattern, then ``optim.decay_filter``; ``model`` tells the
    ``transformers`` filter which parameters sit in a ``LayerNorm`` (by name otherwise).

    Raises:
        ConfigError: a group's pattern matches no parameter (naming it).
    """
    named = list(named_params)
    patterns = [[g.params] if isinstance(g.params, str) else list(g.params) for g in cfg.groups]
    members: list[list[tuple[str, torch.nn.Parameter]]] = [[] for _ in range(len(cfg.groups) + 1)]
    for name, param in named:
        index = next((i for i, pats in enumerate(patterns) if any(fnmatch.fnmatchcase(name, p) for p in pats)), -1)
        members[index + 1].append((name, param))
    for i, (pats, found) in enumerate(zip(patterns, members[1:])):
        if not found:
            shown = ", ".join(n for n, _ in named[:8]) + (", ..." if len(named) > 8 else "")
            raise ConfigError(
                f"optim.groups[{i}].params {pats[0] if len(pats) == 1 else pats!r} matches no trainable "
                f"parameter (an earlier group may take them); the names look like: {shown}"
            )
    settings = [("default", cfg.lr, cfg.weight_decay)] + [
        (f"optim.groups[{i}]", _or(g.lr, cfg.lr), _or(g.weight_decay, cfg.weight_decay))
        for i, g in enumerate(cfg.groups)
    ]
    in_norm = _in_layer_norm(model) if cfg.decay_filter == "transformers" and model is not None else set()
    groups = []
    for (label, lr, decay), found in zip(settings, members):
        kept = [(n, p) for n, p in found if _decays(cfg.decay_filter, n, p, in_norm)]
        rest = [(n, p) for n, p in found if not _decays(cfg.decay_filter, n, p, in_norm)]
        groups.append(ParamGroup(label, [n for n, _ in kept], [p for _, p in kept], lr, decay))
        groups.append(ParamGroup(f"{label}, no decay", [n for n, _ in rest], [p for _, p in rest], lr, 0.0))
    return [g for g in groups if g.params]


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _decays(rule: str, name: str, param: torch.nn.Parameter, in_norm: set[str]) -> bool:
    """Whether ``decay_filter`` ``rule`` gives ``param`` weight decay."""
    if rule == "matrices":
        return param.dim() >= 2
    if rule == "transformers":
        return name not in in_norm and not any(p.search(name.lower()) for p in _NO_DECAY_NAMES)
    return True


def _in_layer_norm(model: torch.nn.Module) -> set[str]:
    """Names of the parameters held by a ``torch.nn.LayerNorm`` (transformers' forbidden layer type)."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if isinstance(module, torch.nn.LayerNorm)
        for name, _ in module.named_parameters()
    }


def build_optimizer(
    cfg: OptimConfig,
    params: Iterable[torch.nn.Parameter] | Iterable[tuple[str, torch.nn.Parameter]],
    model: torch.nn.Module | None = None,
) -> torch.optim.Optimizer:
    """``cfg.target`` (if set) or ``torch.optim``'s ``cfg.name``, over ``param_groups``.

    ``params`` are ``(name, parameter)`` pairs (``model.named_parameters()``), or bare parameters
    without ``optim.groups`` and ``decay_filter``. One group is passed as a plain list of
    parameters; several as param-group dicts (``lr``, ``weight_decay`` each).

    An optimizer of torch whose ``args`` say neither ``fused`` nor ``foreach`` is fused where
    it takes ``fused`` and torch has a fused kernel for the parameters' device and dtype, else
    multi-tensor (``foreach``) where it takes that: the same update, in fewer kernel launches.
    FSDP2's sharded parameters (DTensors) have a fused kernel for AdamW and Adam only."""
    items = list(params)
    if items and not isinstance(items[0], tuple):
        if cfg.groups or cfg.decay_filter != "all":
            raise ValueError("build_optimizer: optim.groups and optim.decay_filter need (name, parameter) pairs")
        items = [(str(i), p) for i, p in enumerate(items)]
    return optimizer_over(cfg, param_groups(cfg, items, model))


def optimizer_over(cfg: OptimConfig, groups: Sequence[ParamGroup]) -> torch.optim.Optimizer:
    """``build_optimizer``'s optimizer over ``groups`` (from ``param_groups``).

    Raises:
        ConfigError: an unknown ``optim.name``, an ``optim.args`` key the optimizer does not take,
            weight decay for one that takes none, a target that returns no optimizer.
    """
    if cfg.target is not None:
        return _from_target(cfg, groups)
    cls = optimizer_class(cfg.name)
    accepts = inspect.signature(cls).parameters
    _check_args(cfg, cls, accepts, groups)
    takes_decay = "weight_decay" in accepts
    common = {"lr": cfg.lr, **({"weight_decay": cfg.weight_decay} if takes_decay else {})}
    given: Any = _given(groups, takes_decay)
    flat = [p for g in groups for p in g.params]
    if not {"fused", "foreach"} & set(cfg.args):
        if "fused" in accepts and (cls in _FUSED_FOR_DTENSOR or not _has_dtensor(flat)):
            try:  # the fastest correct kernel: one fused update of every tensor, where torch has it
                return cls(given, **common, **cfg.args, fused=True)
            except (RuntimeError, ValueError, TypeError):
                pass  # not for this device or dtype: the multi-tensor one (torch's own default on CUDA)
        if "foreach" in accepts:
            try:
                return cls(given, **common, **cfg.args, foreach=True)
            except (RuntimeError, ValueError, TypeError):
                pass
    return cls(given, **common, **cfg.args)


def _check_args(cfg: OptimConfig, cls: type, accepts: Any, groups: Sequence[ParamGroup]) -> None:
    """``optim.args`` name arguments of ``cls``; weight decay only where ``cls`` takes it."""
    for name in cfg.args:
        if name not in accepts or name in ("params", "lr", "weight_decay"):
            why = "set it as optim.lr / optim.weight_decay" if name in ("lr", "weight_decay") else None
            hint = difflib.get_close_matches(name, [k for k in accepts if k != "params"], n=1)
            fix = why or (f"did you mean '{hint[0]}'?" if hint else f"its arguments: {', '.join(list(accepts)[1:])}")
            raise ConfigError(f"optim.args.{name} is not an argument of torch.optim.{cls.__name__}; {fix}")
    if "weight_decay" not in accepts and any(g.weight_decay for g in groups):
        raise ConfigError(
            f"torch.optim.{cls.__name__} takes no weight decay; set optim.weight_decay (and each "
            "optim.groups[i].weight_decay) to 0, or choose an optimizer that takes it"
        )


def _given(groups: Sequence[ParamGroup], takes_decay: bool) -> Any:
    """What the optimizer is given: the default group alone as a plain list (the config's lr and
    weight decay are the optimizer's defaults), else one dict per group."""
    if len(groups) == 1 and groups[0].name == "default":
        return list(groups[0].params)
    return [
        {"params": g.params, "lr": g.lr, **({"weight_decay": g.weight_decay} if takes_decay else {})} for g in groups
    ]


def _from_target(cfg: OptimConfig, groups: Sequence[ParamGroup]) -> torch.optim.Optimizer:
    """``optim.target(params, lr=, weight_decay=, **args)``; ``params`` as ``build_optimizer`` says."""
    given = _given(groups, True)
    common = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    optimizer = build_target(cfg.target, cfg.args, "optim", call_args=(given,), call_kwargs=common)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optim.target={cfg.target!r} returned {type(optimizer).__name__}; it must return a torch.optim.Optimizer"
        )
    return optimizer


def _has_dtensor(params: Sequence[torch.nn.Parameter]) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)
