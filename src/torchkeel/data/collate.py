"""Turning a list of samples into a batch: stack (the default), pad variable lengths, or the user's own.

``collate_or_split`` is what both loaders call: when samples cannot be stacked because a few
have another shape than the rest (a row of the wrong length in a column of fixed-length
vectors), those few are bad samples, named, and the batch is made of the others — never padded
or cut to fit.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import numpy as np
import torch
from torch.utils.data import default_collate

from torchkeel.config.imports import resolve_target
from torchkeel.errors import ConfigError, DataError

LABEL_PAD = -100
"""What integer labels are padded with unless said otherwise: the index cross-entropy ignores."""

PadValue = Union[float, Mapping[Any, float]]


class PadCollate:
    """Stack samples, padding variable-length tensors (dim 0) to the longest in the batch.

    Args:
        pad_value: a number for every field, or a mapping from field to number — dict keys, or
            for tuple samples an index or ``input`` / ``target``; fields it leaves out get 0.
            Integer ``labels`` (and the integer target of an ``(input, target)`` pair) are
            padded with -100, the index cross-entropy ignores, unless the mapping names them.
        mask_key: dict samples that have no such key get one: ``[batch, longest]``, 1 on the
            real elements of the first sequence field (``None``: no mask is added).
        lengths_key: dict samples get each sample's length of the first sequence field under
            this key (``None``, the default: no key is added, so that a strict
            ``forward(input_ids, attention_mask, labels)`` accepts the batch).

    Tuple and dataclass samples keep their shape. The first sequence field is ``input_ids`` if
    the samples have it, else the first whose values are tensors with a dimension.
    """

    def __init__(
        self, pad_value: PadValue = 0.0, *, mask_key: str | None = "attention_mask", lengths_key: str | None = None
    ) -> None:
        self.pad_value, self.mask_key, self.lengths_key = pad_value, mask_key, lengths_key

    def __call__(self, samples: Sequence[Any]) -> Any:
        first = samples[0]
        if isinstance(first, dict):
            _same_keys(samples)
            batch = {key: self._field([s[key] for s in samples], key) for key in first}
            keys = sorted(first, key=lambda key: key != "input_ids")  # the tokens, when there are
            sequence = next((key for key in keys if _is_sequence([s[key] for s in samples])), None)
            if sequence is not None:
                lengths = torch.tensor([s[sequence].shape[0] for s in samples])
                if self.mask_key is not None and self.mask_key not in first:
                    batch[self.mask_key] = (torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).long()
                if self.lengths_key is not None:
                    batch[self.lengths_key] = lengths
            return batch
        if isinstance(first, (tuple, list)):
            is_pair = len(first) == 2
            fields = [self._field([s[i] for s in samples], i, is_target=is_pair and i == 1) for i in range(len(first))]
            return type(first)(*fields) if hasattr(first, "_fields") else type(first)(fields)
        if dataclasses.is_dataclass(first):
            return dataclasses.replace(
                first,
                **{
                    f.name: self._field([getattr(s, f.name) for s in samples], f.name)
                    for f in dataclasses.fields(first)
                    if f.init
                },
            )
        return self._field(list(samples), 0)

    def value_for(self, field: Any, sample: Any, is_target: bool = False) -> float:
        """The pad value of ``field`` (a key or index) whose first value is ``sample``."""
        if isinstance(self.pad_value, Mapping):
            names = [field, str(field)] + (["input"] if field == 0 else ["target"] if is_target else [])
            for name in names:
                if name in self.pad_value:
                    return self.pad_value[name]
        is_label = field == "labels" or is_target
        if is_label and isinstance(sample, torch.Tensor) and not sample.is_floating_point():
            return LABEL_PAD
        return 0.0 if isinstance(self.pad_value, Mapping) else self.pad_value

    def _field(self, values: list[Any], field: Any, is_target: bool = False) -> Any:
        if not isinstance(values[0], torch.Tensor):
            return default_collate(values)
        if not _is_ragged(values):
            return torch.stack(values)
        longest = max(v.shape[0] for v in values)
        out = values[0].new_full(
            (len(values), longest, *values[0].shape[1:]), self.value_for(field, values[0], is_target)
        )
        for i, v in enumerate(values):
            out[i, : v.shape[0]] = v
        return out


class DefaultCollate:
    """``torch.utils.data.default_collate``, plus dataclass samples; a shape mismatch names the fix."""

    def __call__(self, samples: Sequence[Any]) -> Any:
        first = samples[0]
        try:
            if type(first) is tuple:  # the usual (input, target): checked first, it is every step's
                return default_collate(samples if type(samples) is list else list(samples))
            if isinstance(first, Mapping):
                _same_keys(samples)
            if dataclasses.is_dataclass(first) and not isinstance(first, type):
                return dataclasses.replace(
                    first,
                    **{
                        f.name: default_collate([getattr(s, f.name) for s in samples])
                        for f in dataclasses.fields(first)
                        if f.init
                    },
                )
            return default_collate(list(samples))
        except RuntimeError as exc:
            if len({shapes(s) for s in samples}) > 1:
                raise DataError(
                    f"samples of different shapes cannot be stacked ({str(exc).splitlines()[0]}); "
                    "set data.collate=pad for variable-length samples, or give your own"
                ) from None
            raise


def _same_keys(samples: Sequence[Mapping[Any, Any]]) -> None:
    """Dict samples of one batch have one set of keys (else a batch would take the first's)."""
    keys = samples[0].keys()
    if any(sample.keys() != keys for sample in samples):
        raise DataError(f"the samples of a batch have different keys (the first: {sorted(map(str, keys))})")


def collate_or_split(
    collate: Callable[[list[Any]], Any], samples: list[Any], name: Callable[[int], str]
) -> tuple[Any, list[tuple[str, str]], list[int]]:
    """Collate ``samples``; returns the batch, the bad samples ``(name, error)`` and the indices kept.

    When collating fails, the samples are compared: first their structure (keys, kinds of
    values, tensor ranks and dtypes), then — when that agrees — their shapes. Where most of them
    share one, the others are bad samples, named by ``name(i)``, and the rest is collated.
    Without such a majority (lengths that vary everywhere) the error stands: that data needs
    ``collate: pad``.
    """
    try:
        return collate(samples), [], range(len(samples))
    except Exception as exc:  # noqa: BLE001 - re-raised below unless a few samples are unlike the rest
        error = exc
    for describe in (structure, shapes):
        signatures = [describe(s) for s in samples]
        counts = Counter(signatures).most_common()
        if len(counts) < 2:
            continue  # they agree on this: look closer
        if counts[0][1] * 2 <= len(samples):
            break  # no majority to keep
        common = counts[0][0]
        keep = [i for i, sig in enumerate(signatures) if sig == common]
        model = samples[keep[0]]
        bad = [
            (name(i), _difference(samples[i], model, signatures[i], common))
            for i, sig in enumerate(signatures)
            if sig != common
        ]
        return collate([samples[i] for i in keep]), bad, keep
    raise error


def structure(sample: Any) -> tuple[Any, ...]:
    """A sample's keys and kinds of values, with each tensor's rank and dtype (not its sizes)."""
    if isinstance(sample, (torch.Tensor, np.ndarray)):
        return (f"{sample.dtype}[{sample.ndim}]",)
    if isinstance(sample, Mapping):
        return tuple((key, *structure(value)) for key, value in sample.items())
    if isinstance(sample, (tuple, list)):
        return tuple(part for value in sample for part in structure(value))
    if dataclasses.is_dataclass(sample) and not isinstance(sample, type):
        return tuple(part for f in dataclasses.fields(sample) for part in structure(getattr(sample, f.name)))
    return (type(sample).__name__,)


def _difference(sample: Any, model: Any, signature: tuple[Any, ...], common: tuple[Any, ...]) -> str:
    """Why ``sample`` is unlike ``model``, a sample of the batch's majority."""
    if isinstance(sample, Mapping) and isinstance(model, Mapping) and set(sample) != set(model):
        return (
            f"its keys {sorted(map(str, sample))} differ from the other samples' {sorted(map(str, model))} "
            "in its batch; fix or remove it"
        )
    if structure(sample) != structure(model):
        return (
            f"it holds {describe_shapes(structure(sample))} where the other samples of its batch hold "
            f"{describe_shapes(structure(model))}; fix or remove it"
        )
    return (
        f"its shape {describe_shapes(signature)} differs from the other samples' {describe_shapes(common)} "
        "in its batch; fix or remove it"
    )


def shapes(sample: Any) -> tuple[Any, ...]:
    """The shapes of a sample's tensors and arrays, in order (other values as their type)."""
    if isinstance(sample, (torch.Tensor, np.ndarray)):
        return (tuple(sample.shape),)
    if isinstance(sample, Mapping):
        return tuple((key, *shapes(value)) for key, value in sample.items())
    if isinstance(sample, (tuple, list)):
        return tuple(part for value in sample for part in shapes(value))
    if dataclasses.is_dataclass(sample) and not isinstance(sample, type):
        return tuple(part for f in dataclasses.fields(sample) for part in shapes(getattr(sample, f.name)))
    return (type(sample).__name__,)


def describe_shapes(signature: tuple[Any, ...]) -> str:
    parts = [
        f"{p[0]}: {list(p[1])}"
        if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], tuple)
        else str(list(p))
        if isinstance(p, tuple)
        else str(p)
        for p in signature
    ]
    return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"


def _is_sequence(values: list[Any]) -> bool:
    return all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values)


def _is_ragged(values: list[Any]) -> bool:
    return _is_sequence(values) and len({tuple(v.shape) for v in values}) > 1


def build_collate(
    spec: str, pad_value: PadValue = 0.0, *, mask_key: str | None = "attention_mask", lengths_key: str | None = None
) -> Callable[[Sequence[Any]], Any]:
    """``default`` (stack), ``pad`` (``PadCollate``) or ``module:fn`` (called with the list of samples)."""
    if spec == "default":
        return DefaultCollate()
    if spec == "pad":
        return PadCollate(pad_value, mask_key=mask_key, lengths_key=lengths_key)
    if ":" not in spec:
        raise ConfigError(f"data.collate={spec!r} must be default, pad or 'module:function'")

    return resolve_target(spec, "data.collate")
