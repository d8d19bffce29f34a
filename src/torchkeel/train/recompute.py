"""``train.activation_checkpointing``: keep fewer activations, recompute them in the backward pass.

``true`` finds the model's transformer blocks by structure — the modules of a ``ModuleList``
that holds several of one class (GPT-2's ``h``, Llama's ``layers``) — and a transformers model
does its own (``activation_checkpointing_enable``; ``gradient_checkpointing_enable`` before
transformers 5). A list names the classes. Either way the losses are those without it (the
random state is replayed, so dropout draws the same masks), for about a third more compute.
"""

from __future__ import annotations

import collections

import torch

from torchkeel.distributed.parallel import apply_activation_checkpointing
from torchkeel.errors import ConfigError

KEY = "train.activation_checkpointing"


def checkpoint_activations(model: torch.nn.Module, spec: bool | list[str]) -> int:
    """Apply ``spec`` (``true``, a list of class names, or ``false``/``[]``: nothing) to
    ``model`` in place; return the number of blocks whose activations are recomputed."""
    if isinstance(spec, list):
        return apply_activation_checkpointing(model, spec, KEY)
    if not spec:
        return 0
    blocks = repeated_blocks(model)
    if not blocks:
        raise ConfigError(
            f"{KEY}: true found no transformer blocks (a ModuleList of several modules of one class) "
            f"in the model; name the classes instead, e.g. {KEY}=[Block]"
        )
    if getattr(model, "supports_gradient_checkpointing", False):
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            return len(blocks)
        if hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return len(blocks)
    return apply_activation_checkpointing(model, sorted({type(b).__name__ for b in blocks}), KEY)


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of every ``ModuleList`` that holds at least two with parameters of one class."""
    blocks = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            kinds = collections.Counter(type(child) for child in module if any(True for _ in child.parameters()))
            blocks += [child for child in module if kinds[type(child)] >= 2]
    return blocks
