"""Where the loss and the predictions are in what a model returns.

A model may return a tensor, a tuple or list (nanoGPT's ``forward(idx, targets)`` returns
``(logits, loss)``), a dict, or a transformers ``ModelOutput`` (a dict whose keys are also
attributes, an unset one missing from the dict). ``loss.output`` names the loss in it — an int
indexes a tuple, a list or a ``ModelOutput``; a str is a key or an attribute — and
``loss.logits`` the predictions the configured metrics score. A name that finds nothing, or a
loss that is not one number, raises a one-line ``ConfigError`` that names the key to set and
describes what the model returned (types and shapes, no values). Pure functions, no host sync.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Union

import torch

from torchkeel.errors import ConfigError

Where = Union[int, str]
"""An index into a tuple, list or ``ModelOutput``, or a key or attribute name."""

_MISSING = object()
_SHOWN_ITEMS = 8


def describe(value: Any, depth: int = 0) -> str:
    """Types and shapes of ``value``: ``tuple (Tensor[8, 64, 65] float32, Tensor[] float32)``."""
    if isinstance(value, torch.Tensor):
        return f"Tensor[{', '.join(map(str, value.shape))}] {str(value.dtype).removeprefix('torch.')}"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value) if depth else f"{type(value).__name__} {value!r}"
    name = type(value).__name__
    if depth >= 2 or not isinstance(value, (Mapping, tuple, list)):
        return name
    if isinstance(value, Mapping):
        items = [f"{k}: {describe(v, depth + 1)}" for k, v in list(value.items())[:_SHOWN_ITEMS]]
        more = ", …" if len(value) > _SHOWN_ITEMS else ""
        return f"{name} {{{', '.join(items)}{more}}}"
    items = [describe(v, depth + 1) for v in value[:_SHOWN_ITEMS]]
    return f"{name} ({', '.join(items)}{', …' if len(value) > _SHOWN_ITEMS else ''})"


def is_scalar(value: Any) -> bool:
    """A tensor that holds one number (what ``backward()`` takes without a gradient)."""
    return isinstance(value, torch.Tensor) and value.numel() == 1


def pick(out: Any, where: Where, key: str) -> Any:
    """``out[where]`` (a tuple, a list, a dict or a ``ModelOutput``) or ``out.where`` (an object).

    Raises:
        ConfigError: nothing is there; the message names ``key`` and what ``out`` holds.
    """
    if isinstance(where, int) and not isinstance(where, bool):
        items = _items(out)
        if items is None:
            raise ConfigError(
                f"{key}: {where} indexes a tuple or list, but the model returned {describe(out)}; "
                f"name a key instead ({key}: {_suggest_key(out, key)})"
            )
        if not -len(items) <= where < len(items):
            raise ConfigError(
                f"{key}: {where} is out of range: the model returned {describe(out)} "
                f"({len(items)} items); set {key} to an index from 0 to {len(items) - 1}"
            )
        return items[where]
    if isinstance(out, Mapping):
        found = out.get(where, _MISSING)
    elif isinstance(out, (tuple, list)) and not hasattr(out, "_fields"):  # a namedtuple has names
        raise ConfigError(
            f"{key}: {where!r} names a key, but the model returned {describe(out)}; set {key} to an index "
            f"({key}: {_suggest_index(out, key)})"
        )
    else:
        found = getattr(out, where, _MISSING)
    if found is _MISSING or found is None:
        raise ConfigError(
            f"{key}: {where!r} found nothing in what the model returned, {describe(out)}; set {key} "
            f"to where it is ({key}: {suggest(out, key)})"
        )
    return found


def pick_loss(out: Any, where: Where, call: str) -> torch.Tensor:
    """The loss at ``where`` (``loss.output``) in what ``call`` returned, as a 0-d tensor.

    Raises:
        ConfigError: it is missing or not one number; the message names ``loss.output``.
    """
    loss = pick(out, where, "loss.output")
    if not is_scalar(loss):
        hint = suggest(out, "loss.output")
        raise ConfigError(
            f"loss.output: {where!r} picks {describe(loss)} from what {call} returned, {describe(out)}; "
            f"it must pick the loss, one number (loss.output: {hint})"
        )
    return as_scalar(loss)


def as_scalar(loss: torch.Tensor) -> torch.Tensor:
    """A one-number tensor as a 0-d one (``[1]`` from a ``DataParallel``-style gather); no copy."""
    return loss if loss.dim() == 0 else loss.reshape(())


def default_logits(out: Any) -> Any:
    """The predictions when ``loss.logits`` is not set: ``logits`` of a dict or an object that has
    it (a transformers output); none for a tuple (which item is which is not guessed)."""
    if isinstance(out, Mapping):
        return out.get("logits")
    if isinstance(out, (tuple, list, torch.Tensor)):
        return None
    return getattr(out, "logits", None)


def _items(out: Any) -> tuple[Any, ...] | list[Any] | None:
    """What an int indexes: a tuple or list, or a ``ModelOutput``'s values in order."""
    if isinstance(out, (tuple, list)):
        return out
    to_tuple = getattr(out, "to_tuple", None)  # transformers' ModelOutput
    return to_tuple() if isinstance(out, Mapping) and callable(to_tuple) else None


def suggest(out: Any, key: str) -> str:
    """A likely value of ``key`` (``loss.output`` or ``loss.logits``) for ``out``, for an error's hint."""
    return _suggest_index(out, key) if isinstance(out, (tuple, list)) else _suggest_key(out, key)


def _suggest_index(out: Any, key: str) -> str:
    """The index that likely holds the loss (one number, or None: a model called without its
    targets) or the predictions (a tensor of more than one number)."""
    wants_loss = key == "loss.output"
    for i, item in enumerate(out):
        if (wants_loss and (item is None or is_scalar(item))) or (
            not wants_loss and isinstance(item, torch.Tensor) and not is_scalar(item)
        ):
            return str(i)
    return "<index>"


def _suggest_key(out: Any, key: str) -> str:
    """The usual name if ``out`` has it, else the first key whose value looks like the wanted item."""
    if isinstance(out, Mapping):
        fields = dict(out)
    elif hasattr(out, "__dict__"):
        fields = {n: v for n, v in vars(out).items() if not n.startswith("_")}
    else:
        return "<key>"
    wants_loss = key == "loss.output"
    usual = "loss" if wants_loss else "logits"
    if fields.get(usual) is not None:
        return usual
    found = [str(n) for n, v in fields.items() if isinstance(v, torch.Tensor) and wants_loss == is_scalar(v)]
    return found[0] if found else "<key>"
