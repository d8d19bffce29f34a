"""Turning a list of samples into a batch: stack (the default), pad variable lengths, or the user's own."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

from torchkeel.errors import ConfigError, DataError


class PadCollate:
    """Stack samples, padding variable-length tensors (dim 0) to the longest in the batch.

    Every tensor field with a dimension is a sequence. Dict samples also get, for the first
    sequence key, ``lengths`` (``[batch]``) and ``attention_mask`` (``[batch, longest]``, 1 on
    real elements) — in every batch, even one whose lengths happen to be equal — and
    ``<key>_lengths`` / ``<key>_mask`` for further sequence keys. Tuple and dataclass samples
    keep their shape.
    """

    def __init__(self, pad_value: float = 0.0) -> None:
        self.pad_value = pad_value

    def __call__(self, samples: Sequence[Any]) -> Any:
        first = samples[0]
        if isinstance(first, dict):
            batch: dict[str, Any] = {}
            named = False
            for key in first:
                values = [s[key] for s in samples]
                batch[key] = self._field(values)
                if all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values):
                    lengths = torch.tensor([v.shape[0] for v in values])
                    mask = (torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).long()
                    prefix = "" if not named else f"{key}_"
                    batch[f"{prefix}lengths"] = lengths
                    batch[f"{prefix}attention_mask" if not named else f"{key}_mask"] = mask
                    named = True
            return batch
        if isinstance(first, (tuple, list)):
            fields = [self._field([s[i] for s in samples]) for i in range(len(first))]
            return type(first)(*fields) if hasattr(first, "_fields") else type(first)(fields)
        if dataclasses.is_dataclass(first):
            return dataclasses.replace(first, **{f.name: self._field([getattr(s, f.name) for s in samples])
                                                  for f in dataclasses.fields(first) if f.init})
        return self._field(list(samples))

    def _field(self, values: list[Any]) -> Any:
        if not isinstance(values[0], torch.Tensor):
            return default_collate(values)
        if not _is_ragged(values):
            return torch.stack(values)
        longest = max(v.shape[0] for v in values)
        out = values[0].new_full((len(values), longest, *values[0].shape[1:]), self.pad_value)
        for i, v in enumerate(values):
            out[i, : v.shape[0]] = v
        return out


class DefaultCollate:
    """``torch.utils.data.default_collate``, plus dataclass samples; a shape mismatch names the fix."""

    def __call__(self, samples: Sequence[Any]) -> Any:
        first = samples[0]
        try:
            if dataclasses.is_dataclass(first) and not isinstance(first, type):
                return dataclasses.replace(first, **{f.name: default_collate([getattr(s, f.name) for s in samples])
                                                      for f in dataclasses.fields(first) if f.init})
            return default_collate(list(samples))
        except RuntimeError as exc:
            if "stack expects each tensor to be equal size" in str(exc):
                raise DataError(f"samples of different shapes cannot be stacked ({str(exc).splitlines()[0]}); "
                                "set data.collate=pad for variable-length samples, or give your own") from None
            raise


def _is_ragged(values: list[Any]) -> bool:
    return (all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values)
            and len({tuple(v.shape) for v in values}) > 1)


def build_collate(spec: str, pad_value: float = 0.0) -> Callable[[Sequence[Any]], Any]:
    """``default`` (stack), ``pad`` (``PadCollate``) or ``module:fn`` (called with the list of samples)."""
    if spec == "default":
        return DefaultCollate()
    if spec == "pad":
        return PadCollate(pad_value)
    if ":" not in spec:
        raise ConfigError(f"data.collate={spec!r} must be default, pad or 'module:function'")
    from torchkeel.config.imports import resolve_target

    return resolve_target(spec, "data.collate")
