"""The inputs an export is built and checked with: the run's own batches, as its loader made them.

Whatever the data (map-style datasets, Parquet, WebDataset) and batch shape, the batches come
from the same ``build`` functions training used (``data.preprocess`` and ``data.transform``
applied, ``collate: pad`` padding) and reach the model through the run's own objective
(``torchkeel.export.signature``): validation batches for parity, up to 2,048 training samples
for the drift reference.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from torchkeel.config.schema import KeelConfig
from torchkeel.data.build import loader_factory, resolve_data
from torchkeel.export.signature import (
    Call,
    ExportModule,
    Signature,
    capture_calls,
    dynamic_axes,
    signature_of,
)
from torchkeel.export.stats import reference_stats
from torchkeel.train.build import build_objective

REFERENCE_SAMPLES = 2048
PARITY_BATCHES = 3  # at least this many validation batches: padded sequences come in several lengths


@dataclass
class RunInputs:
    """The model's named inputs, learnt from real batches: ``feeds[0]`` is checked at every
    batch size, the reference statistics come from ``reference_feeds``."""

    signature: Signature
    feeds: list[dict[str, torch.Tensor]]
    reference_feeds: list[dict[str, torch.Tensor]]
    axes: dict[str, list[int]]
    train_data: Any = None
    """The run's training dataset or source (a dataset's ``classes`` name the output labels)."""
    max_length: int | None = None
    """The longest sequence the model takes (see ``max_length``)."""
    sequence: dict[str, list[int]] = field(default_factory=dict)
    """Per input, its sequence axes (shortened together; at most ``max_length`` long)."""

    def max_shape(self, name: str) -> list[int] | None:
        """``max_length`` on the input's sequence axes, ``-1`` elsewhere; ``None`` without a limit."""
        if self.max_length is None or name not in self.sequence:
            return None
        return [self.max_length if axis in self.sequence[name] else -1 for axis in range(self.feeds[0][name].dim())]

    def dims(self, name: str) -> list[str] | None:
        """A name per axis when the input has a dynamic axis besides the batch (``None`` otherwise):
        ``batch``, and ``length``, ``length_2``… shared by the axes that had the same size in
        every batch (a padded sequence's tokens and its mask)."""
        if self.axes[name] == [0]:
            return None
        feeds = self.feeds + self.reference_feeds
        groups: dict[tuple[int, ...], str] = {}
        for other in self.signature.names:
            for axis in self.axes[other][1:]:
                key = tuple(int(feed[other].shape[axis]) for feed in feeds)
                groups.setdefault(key, "length" if not groups else f"length_{len(groups) + 1}")
        dims = [str(size) for size in self.feeds[0][name].shape]
        dims[0] = "batch"
        for axis in self.axes[name][1:]:
            dims[axis] = groups[tuple(int(feed[name].shape[axis]) for feed in feeds)]
        return dims

    def shape(self, name: str) -> list[int]:
        """The input's shape for ``model.json``: ``-1`` on its dynamic axes."""
        dims = list(self.feeds[0][name].shape)
        return [-1 if d in self.axes[name] else size for d, size in enumerate(dims)]

    def output_shape(self, module: ExportModule, output: torch.Tensor) -> list[int]:
        """The output's shape: ``-1`` on the batch and on every axis that follows an input's length."""
        shapes = {tuple(output.shape[1:])}
        with torch.inference_mode():
            for feed in self.other_shapes():
                shapes.add(tuple(module(*(t[:1] for t in feed.values())).shape[1:]))
        rest = list(output.shape[1:])
        return [-1, *(-1 if len({s[d] for s in shapes}) > 1 else size for d, size in enumerate(rest))]

    def other_shapes(self) -> list[dict[str, torch.Tensor]]:
        """Up to two more batches whose dynamic axes have other sizes than the first's."""
        seen = {self._key(self.feeds[0])}
        others = []
        for feed in itertools.chain(self.feeds[1:], self.reference_feeds):
            key = self._key(feed)
            if key not in seen and len(others) < 2:
                seen.add(key)
                others.append({name: t[:8] for name, t in feed.items()})
        return others

    def reference(self) -> dict[str, Any] | None:
        """Drift statistics of the first input of a fixed shape (a padded sequence has none)."""
        fixed = [name for name in self.signature.names if self.axes[name] == [0]]
        if not fixed:
            return None
        name = fixed[0]
        values = torch.cat([feed[name] for feed in self.reference_feeds])[:REFERENCE_SAMPLES]
        return {**reference_stats(values.double().numpy()), "input": name}

    def _key(self, feed: dict[str, torch.Tensor]) -> tuple[Any, ...]:
        return tuple(tuple(t.shape[1:]) for t in feed.values())


def run_inputs(config: KeelConfig, model: torch.nn.Module, limit: int) -> RunInputs:
    """Read the run's batches (validation first, training for the reference) and learn the
    model's inputs from how the run's objective calls it."""
    train_data, val_data = resolve_data(config.data)
    make = loader_factory(config.data, batch_size=config.train.batch_size, seed=config.seed, device=torch.device("cpu"))
    objective = build_objective(config.loss, None, model, carry=config.train.carry)
    parity_data = val_data if val_data is not None else train_data
    calls = _calls(model, objective, make(parity_data, 0, train=False), limit, PARITY_BATCHES)
    reference_calls = _calls(model, objective, make(train_data, 0), REFERENCE_SAMPLES, 1)
    signature = signature_of(model, calls)
    feeds = [_floats(signature.feed(call)) for call in calls]
    reference_feeds = [_floats(signature.feed(call)) for call in reference_calls]
    axes = dynamic_axes(signature, calls + reference_calls)
    declared = sequence_axes(_declared_axes(train_data, model), feeds + reference_feeds)
    if declared:  # token blocks all of one length: the export still takes any length up to it
        for name, extra in declared.items():
            axes[name] = sorted({*axes[name], *extra})
        feeds.append(_shortened(feeds[0], declared))
    return RunInputs(signature, feeds, reference_feeds, axes, train_data, max_length(model, train_data), declared)


def max_length(model: torch.nn.Module, train_data: Any) -> int | None:
    """The longest sequence the model takes: its positions (a transformers config's
    ``max_position_embeddings``), else the token source's ``block_size``; ``None`` when neither says."""
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        return positions
    block = getattr(train_data, "block_size", None)
    return block if isinstance(block, int) and block > 0 else None


def _declared_axes(train_data: Any, model: torch.nn.Module) -> dict[str, list[int]]:
    """The sequence axes the data source declares, or those of a transformers sequence model's
    ``input_ids`` (a ``datasets`` or map-style run of token ids: its rows may all be one length)."""
    declared = dict(getattr(train_data, "sequence_axes", {}))
    if not declared and isinstance(getattr(getattr(model, "config", None), "max_position_embeddings", None), int):
        declared = {"input_ids": [1]}
    return declared


def sequence_axes(declared: dict[str, list[int]], feeds: list[dict[str, torch.Tensor]]) -> dict[str, list[int]]:
    """``declared`` sequence axes, and every axis of another input that has the same size as one
    of them in every batch (the ``attention_mask`` that padding adds, the labels): they are
    shortened together."""
    present = {name: list(axes) for name, axes in declared.items() if feeds and name in feeds[0]}
    sizes = {
        tuple(int(feed[name].shape[axis]) for feed in feeds)
        for name, axes in present.items()
        for axis in axes
        if axis < feeds[0][name].dim()
    }
    out: dict[str, list[int]] = {}
    for name, tensor in feeds[0].items() if feeds else ():
        found = [
            axis
            for axis in range(1, tensor.dim())
            if axis in present.get(name, [])
            or (not tensor.is_floating_point() and tuple(int(feed[name].shape[axis]) for feed in feeds) in sizes)
        ]
        if found:
            out[name] = found
    return out


def _shortened(feed: dict[str, torch.Tensor], axes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """``feed`` with its declared sequence axes cut to half their length, to check the export at
    another length than the data's."""
    out = {}
    for name, tensor in feed.items():
        for axis in axes.get(name, []):
            tensor = tensor.narrow(axis, 0, max(1, tensor.shape[axis] // 2))
        out[name] = tensor
    return out


def _calls(model: torch.nn.Module, objective: Any, loader: Any, limit: int, min_batches: int) -> list[Call]:
    batches = loader.epoch(0)
    try:
        return capture_calls(model, objective, batches, limit_samples=limit, min_calls=min_batches)
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
        loader.close()


def _floats(feed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Floating inputs as float32 (the model is exported in fp32); integer inputs (token ids) as they are."""
    return {name: t.float() if t.is_floating_point() else t for name, t in feed.items()}
